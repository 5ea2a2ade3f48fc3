"""Build frozen dataclasses from YAML + `a.b.c=value` overrides, with errors that name the field.

Each component owns its config dataclass and validates itself in `__post_init__` by raising
`ConfigError(field, value, problem)` with its *local* field name; the loader prefixes the path
of the enclosing fields, so the user reads e.g. `parallel.tp=3: does not divide
num_attention_heads=8`.

A key that moved elsewhere is listed in the class's `MOVED: ClassVar[dict[str, str]]` (old
local name → where it went, in words); an old config then fails naming the new place rather
than with a bare "unknown field".

`check_config` reports every problem it can instead of the first: each field on its own
(recursively, each component's `__post_init__`), then — when every field of a class is valid —
that class's own cross-field checks. A class whose cross-field checks find several problems
raises them together as `ConfigErrors` (`run_checks`), which `check_config` lists one by one.
A file that is not YAML raises `ConfigFileError`, one line `file:line:col: problem`. Every
command exits `CONFIG_ERROR_EXIT` on a config error.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

import yaml

from mcore_rl.config.derived import derived_field_type
from mcore_rl.config.paths import resolve_relative

T = TypeVar("T")

CONFIG_ERROR_EXIT = 2  # the exit code of every command whose config does not load


class ConfigError(ValueError):
    """A config value is wrong. `field` is the dotted path, e.g. `parallel.tp`."""

    def __init__(self, field: str, value: Any, problem: str):
        self.field, self.value, self.problem = field, value, problem
        super().__init__(f"{field}={value!r}: {problem}")

    def under(self, prefix: str) -> ConfigError:
        return ConfigError(
            f"{prefix}.{self.field}" if prefix else self.field, self.value, self.problem
        )


class ConfigErrors(ConfigError):
    """Several problems at once, e.g. every failed cross-field check of one class. Reads as
    the first (`field`, `value`, `problem`) to code that expects one; its message lists them
    all, one per line; `errors` holds each."""

    def __init__(self, errors: Iterable[ConfigError]):
        self.errors = [e for err in errors for e in getattr(err, "errors", [err])]
        if not self.errors:
            raise ValueError("ConfigErrors needs at least one error")
        first = self.errors[0]
        super().__init__(first.field, first.value, first.problem)
        self.args = ("\n".join(str(err) for err in self.errors),)

    def __str__(self) -> str:
        return self.args[0]

    def under(self, prefix: str) -> ConfigErrors:
        return ConfigErrors(err.under(prefix) for err in self.errors)


def raise_errors(errors: list[ConfigError]) -> None:
    """Raise nothing, the one error, or several as `ConfigErrors`."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


def run_checks(obj: Any, checks: Iterable[Callable[[Any], None]]) -> list[ConfigError]:
    """Run every check on `obj` (each raises ConfigError naming its field) and return what
    they raised, in order: the checks are independent, so one failing does not hide another."""
    errors: list[ConfigError] = []
    for check in checks:
        try:
            check(obj)
        except ConfigError as err:
            errors.extend(getattr(err, "errors", [err]))
    return errors


class ConfigFileError(ConfigError):
    """The config file cannot be read as a YAML mapping; the message is one line,
    `file:line:col: problem` (`file: problem` when there is no position)."""

    def __init__(
        self, path: str | Path, problem: str, line: int | None = None, col: int | None = None
    ):
        super().__init__("config", str(path), problem)
        self.path, self.line, self.col = str(path), line, col
        where = f"{path}:{line}:{col}" if line is not None else str(path)
        self.args = (f"{where}: {problem}",)

    def __str__(self) -> str:
        return self.args[0]


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML mapping at `path`; raises ConfigFileError naming the file (and, for a syntax
    error, the line and column, 1-based) instead of YAML's own multi-line message."""
    path = Path(path)
    if not path.is_file():
        raise ConfigFileError(path, "no such file")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigFileError(path, f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "not valid YAML"
        if err.context and err.problem and err.context_mark is not None:
            problem += (
                f" ({err.context} at line {err.context_mark.line + 1}, column "
                f"{err.context_mark.column + 1})"
            )
        if mark is None:
            raise ConfigFileError(path, problem) from None
        raise ConfigFileError(path, problem, mark.line + 1, mark.column + 1) from None
    except yaml.YAMLError as err:
        raise ConfigFileError(path, " ".join(str(err).split())) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigFileError(path, f"top level must be a mapping, not a {type(loaded).__name__}")
    return loaded


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` → nested dict; values are parsed as YAML scalars/lists."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, None, "override must look like a.b.c=value")
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(key, raw, f"'{part}' is set to a value and a section at once")
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None
) -> T:
    """Read YAML at `path` (optional), apply overrides, build and validate `cls`. Raises the
    first ConfigError (`check_config` returns them all)."""
    cfg, errors = check_config(cls, path, overrides)
    if errors:
        raise errors[0]
    assert cfg is not None  # built: no errors
    return cfg


def check_config(
    cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None
) -> tuple[T | None, list[ConfigError]]:
    """`load_config`, returning every problem found instead of raising the first: (the
    config, []) or (None, errors). Raises ConfigFileError when the file cannot be read and
    ConfigError for a malformed override (nothing to check then). A field that names a file
    relative to its config (`config.paths`) is made absolute: against the YAML file's
    directory, or the working directory for an override."""
    data = (
        {}
        if path is None
        else resolve_relative(cls, read_config_file(path), Path(path).resolve().parent)
    )
    extra = resolve_relative(cls, parse_overrides(overrides or []), Path.cwd())
    return collect(cls, _merge(data, extra))


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, checking names and types of every field;
    raises the first problem (`collect` returns them all)."""
    cfg, errors = collect(cls, data, prefix)
    if errors:
        raise errors[0]
    assert cfg is not None  # built: no errors
    return cfg


def collect(cls: type[T], data: Any, prefix: str = "") -> tuple[T | None, list[ConfigError]]:
    """Build `cls` from a mapping: (the object, []) or (None, every problem). Each field is
    checked on its own, nested configs recursively; the class's own checks (`__post_init__`,
    which see several fields at once) run only when every field is valid — they would
    otherwise judge a value that is already wrong."""
    if not isinstance(data, dict):
        return None, [ConfigError(prefix or cls.__name__, data, "expected a mapping")]
    hints = get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls)) if f.init}
    unknown = sorted(set(data) - set(fields))
    moved = getattr(cls, "MOVED", {})
    errors = [
        ConfigError(_join(prefix, name), data[name], f"this key moved: {moved[name]}")
        for name in unknown
        if name in moved
    ]
    errors += [
        ConfigError(
            _join(prefix, name),
            data[name],
            f"unknown field{_did_you_mean(name, fields, prefix)}; allowed: "
            f"{', '.join(sorted(fields))}",
        )
        for name in unknown
        if name not in moved
    ]
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            continue
        value, path = _with_defaults(fields[name], value), _join(prefix, name)
        if dataclasses.is_dataclass(hints[name]):
            kwargs[name], errs = collect(hints[name], value, path)
            errors += errs
            continue
        try:
            kwargs[name] = _coerce(hints[name], value, path)
        except ConfigError as err:
            errors.append(err)
    if errors:
        return None, errors
    try:
        built = cls(**kwargs)
        # a class with `null = derived` fields of its own returns itself with them decided
        derive = getattr(built, "derived", None)
        return (derive() if callable(derive) else built), []
    except ConfigError as err:  # ConfigErrors: each of them
        return None, [e.under(prefix) for e in getattr(err, "errors", [err])]
    except TypeError as err:  # a required field is missing
        return None, [ConfigError(prefix or cls.__name__, None, str(err))]


def _did_you_mean(name: str, known: Iterable[str], prefix: str) -> str:
    """ " (did you mean a.b?)" naming the known keys of that level closest to `name`
    (difflib's ratio >= 0.6, at most 3, the closest first), or "" when none is close."""

    close = [
        _join(prefix, key)
        for key in difflib.get_close_matches(str(name), list(known), n=3, cutoff=0.6)
    ]
    if not close:
        return ""
    keys = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f" (did you mean {keys}?)"


def _with_defaults(field: dataclasses.Field, value: Any) -> Any:
    """A partial mapping for a nested config keeps the parent's defaults for that section
    (e.g. `rollout.tp=2` keeps the run's own rollout.max_model_len, not the class default)."""
    if isinstance(value, dict) and field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
        if dataclasses.is_dataclass(default):
            return _merge(to_dict(default), value)
    return value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _coerce(tp: Any, value: Any, path: str) -> Any:
    derived_type = derived_field_type(tp)
    if derived_type is not None:  # Derived[X]: null (the owner derives it) or an X
        return None if value is None else _coerce(derived_type, value, path)
    origin = get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        present = [option for option in options if option is not type(None)]
        if len(present) == 1:  # X | None: X's own error, naming its field
            return _coerce(present[0], value, path)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, path)
            except ConfigError as err:
                errors.append(err.problem)
        raise ConfigError(path, value, "; ".join(errors))
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(path, value, f"allowed values: {', '.join(map(str, allowed))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, value, "expected a list")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, value, "expected a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "expected an integer")
        return value
    if tp is float:
        # YAML 1.1 reads 2e-3 (no dot) as a string
        number = _float_or_none(value) if isinstance(value, str) else value
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(path, value, "expected a number")
        return float(number)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "expected a string")
        return value
    return value


def to_dict(obj: Any) -> Any:
    """Dataclass → plain dict (for logging the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def write_config(obj: Any, path: str | Path) -> Path:
    """`obj` (a config dataclass) as YAML at `path`, written whole or not at all (a temp file
    beside it, then renamed over it); `load_config(type(obj), path)` reads it back equal."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(yaml.safe_dump(to_dict(obj), sort_keys=False), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


__all__ = [
    "CONFIG_ERROR_EXIT",
    "ConfigError",
    "ConfigErrors",
    "ConfigFileError",
    "check_config",
    "collect",
    "from_dict",
    "load_config",
    "parse_overrides",
    "raise_errors",
    "read_config_file",
    "run_checks",
    "to_dict",
    "write_config",
]
