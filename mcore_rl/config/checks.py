"""Range checks shared by the config dataclasses' `__post_init__`.

Each helper checks the named fields of `cfg` in order and raises `ConfigError(name, value,
problem)` for the first one out of range, with the field's *local* name (the loader prefixes
the enclosing fields' path) and the same problem text in every config:

    require_at_least(self, 1, "tp", "pp")        tp=0: must be >= 1
    require_above(self, 0, "lr")                 lr=0.0: must be > 0
    require_in_range(self, 0, 1, "adam_beta1", high_open=True)
                                                 adam_beta1=1.0: must be in [0, 1)
    require_in_range(self, 0, "lr", "min_lr")    min_lr=0.1: must be in [0, lr=0.001]
    require_one_of(self, "kl_mode", KL_MODES)    kl_mode='x': allowed values: loss, reward

`optional=True` lets a field be None (null: off, or derived). `note` is appended in
parentheses, e.g. `note="or null"` → "must be >= 1 (or null)"; `problem` replaces the text
where a field's message reads differently (e.g. "must be null (derived) or >= 1"). A bound
given as a string is another field of `cfg`, shown as `name=value`. NaN is out of every range.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from mcore_rl.config.loader import ConfigError


def _check(
    cfg: Any,
    names: tuple[str, ...],
    ok: Callable[[Any], bool],
    problem: str,
    optional: bool,
    note: str,
    text: str | None,
) -> None:
    if text is not None:
        problem = text
    if note:
        problem = f"{problem} ({note})"
    for name in names:
        value = getattr(cfg, name)
        if value is None and optional:
            continue
        if not ok(value):
            raise ConfigError(name, value, problem)


def _bound(cfg: Any, bound: float | str) -> tuple[float, str]:
    """A bound's value and how the message shows it: a number, or another field by name."""
    if isinstance(bound, str):
        value = getattr(cfg, bound)
        return value, f"{bound}={value}"
    return bound, str(bound)


def require_at_least(
    cfg: Any,
    low: float | str,
    *names: str,
    optional: bool = False,
    note: str = "",
    problem: str | None = None,
) -> None:
    """Each named field is >= `low`, else ConfigError(name, value, "must be >= low")."""
    low, shown = _bound(cfg, low)
    _check(cfg, names, lambda v: v >= low, f"must be >= {shown}", optional, note, problem)


def require_above(
    cfg: Any,
    low: float | str,
    *names: str,
    optional: bool = False,
    note: str = "",
    problem: str | None = None,
) -> None:
    """Each named field is > `low`, else ConfigError(name, value, "must be > low")."""
    low, shown = _bound(cfg, low)
    _check(cfg, names, lambda v: v > low, f"must be > {shown}", optional, note, problem)


def require_in_range(
    cfg: Any,
    low: float | str,
    high: float | str,
    *names: str,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    note: str = "",
    problem: str | None = None,
) -> None:
    """Each named field is within [low, high] (an open end excludes its bound), else
    ConfigError(name, value, "must be in [low, high]") with `(` / `)` for an open end."""
    (low, low_shown), (high, high_shown) = _bound(cfg, low), _bound(cfg, high)

    def ok(v: Any) -> bool:
        return (low < v if low_open else low <= v) and (v < high if high_open else v <= high)

    interval = f"{'(' if low_open else '['}{low_shown}, {high_shown}{')' if high_open else ']'}"
    _check(cfg, names, ok, f"must be in {interval}", optional, note, problem)


def require_one_of(
    cfg: Any,
    name: str,
    allowed: Iterable[Any],
    *,
    optional: bool = False,
    note: str = "",
    problem: str | None = None,
) -> None:
    """The named field is one of `allowed`, else ConfigError(name, value, "allowed values:
    a, b, c")."""
    allowed = tuple(allowed)
    _check(
        cfg,
        (name,),
        lambda v: v in allowed,
        f"allowed values: {', '.join(map(str, allowed))}",
        optional,
        note,
        problem,
    )


__all__ = ["require_above", "require_at_least", "require_in_range", "require_one_of"]
