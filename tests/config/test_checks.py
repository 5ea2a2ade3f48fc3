"""The shared range checks of `mcore_rl.config.checks`: each raises ConfigError naming the
field, with the value and the same problem text in every config, and accepts what is in range."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from mcore_rl.config import (ConfigError, from_dict, require_above, require_at_least,
                             require_in_range, require_one_of)

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@dataclass
class Cfg:
    a: float = 1
    b: float = 2
    c: float | None = None
    top: float = 10


def raised(check, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check(*args, **kwargs)
    return info.value


def test_at_least():
    require_at_least(Cfg(a=1, b=1), 1, "a", "b")
    require_at_least(Cfg(a=0), 0, "a")
    err = raised(require_at_least, Cfg(a=1, b=0), 1, "a", "b")
    assert (err.field, err.value, err.problem) == ("b", 0, "must be >= 1")
    assert str(err) == "b=0: must be >= 1"


def test_at_least_names_the_first_field_out_of_range_in_order():
    assert raised(require_at_least, Cfg(a=-1, b=-2), 0, "b", "a").field == "b"


def test_optional_lets_none_pass_and_note_is_appended():
    cfg = Cfg(c=None)
    require_at_least(cfg, 1, "c", optional=True)
    with pytest.raises(TypeError):  # None is not a number unless the field is optional
        require_at_least(cfg, 1, "c")
    err = raised(require_at_least, Cfg(c=0), 1, "c", optional=True, note="or null")
    assert str(err) == "c=0: must be >= 1 (or null)"


def test_problem_replaces_the_text():
    err = raised(require_at_least, Cfg(c=0), 1, "c", optional=True,
                 problem="must be null (derived) or >= 1")
    assert str(err) == "c=0: must be null (derived) or >= 1"


def test_above():
    require_above(Cfg(a=0.5), 0, "a")
    err = raised(require_above, Cfg(a=0.0), 0, "a")
    assert str(err) == "a=0.0: must be > 0"
    err = raised(require_above, Cfg(c=1.0), 1, "c", optional=True,
                 note="null turns dual-clip off")
    assert str(err) == "c=1.0: must be > 1 (null turns dual-clip off)"
    require_above(Cfg(c=None), 1, "c", optional=True)


@pytest.mark.parametrize("value,low_open,high_open,ok", [
    (0, False, False, True), (1, False, False, True), (0.5, True, True, True),
    (0, True, False, False), (1, False, True, False), (-0.1, False, False, False),
    (1.1, False, False, False)])
def test_in_range(value, low_open, high_open, ok):
    cfg = Cfg(a=value)
    if ok:
        require_in_range(cfg, 0, 1, "a", low_open=low_open, high_open=high_open)
        return
    err = raised(require_in_range, cfg, 0, 1, "a", low_open=low_open, high_open=high_open)
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    assert (err.field, err.value, err.problem) == ("a", value, f"must be in {interval}")


def test_a_bound_named_by_field_shows_its_value():
    require_in_range(Cfg(a=10, top=10), 0, "top", "a")
    err = raised(require_in_range, Cfg(a=11, top=10), 0, "top", "a")
    assert str(err) == "a=11: must be in [0, top=10]"
    err = raised(require_at_least, Cfg(a=1, top=10), "top", "a")
    assert str(err) == "a=1: must be >= top=10"


def test_nan_is_out_of_every_range():
    nan = math.nan
    for check, args in ((require_at_least, (0,)), (require_above, (0,)),
                        (require_in_range, (0, 1))):
        assert raised(check, Cfg(a=nan), *args, "a").field == "a"


def test_one_of():
    require_one_of(Cfg(a=2), "a", (1, 2))
    err = raised(require_one_of, Cfg(a=3), "a", (1, 2))
    assert str(err) == "a=3: allowed values: 1, 2"
    require_one_of(Cfg(c=None), "c", ("x",), optional=True)


@dataclass(frozen=True, kw_only=True)
class Inner:
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        require_at_least(self, 1, "tp", "pp")


@dataclass(frozen=True, kw_only=True)
class Outer:
    inner: Inner = field(default_factory=Inner)


def test_the_loader_prefixes_the_enclosing_fields():
    with pytest.raises(ConfigError, match=r"^inner\.pp=0: must be >= 1$"):
        from_dict(Outer, {"inner": {"pp": 0}})
