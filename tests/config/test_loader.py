"""The config loader's scalar rules: what YAML and `a.b=c` overrides may spell a number as."""

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.trainer.rl_config import RLConfig


@pytest.mark.parametrize("override, expected", [
    ("warmup.train.optimizer.lr=2e-3", 2e-3),   # YAML 1.1 reads this as a string
    ("warmup.train.optimizer.lr=2.0e-3", 2e-3),
    ("warmup.train.optimizer.lr=1", 1.0),
])
def test_a_float_field_takes_every_spelling_of_a_number(override, expected):
    cfg = load_config(RLConfig, None, [override])
    assert cfg.warmup.train.optimizer.lr == expected
    assert isinstance(cfg.warmup.train.optimizer.lr, float)


@pytest.mark.parametrize("override", ["warmup.train.optimizer.lr=fast",
                                      "warmup.train.optimizer.lr=true"])
def test_a_float_field_refuses_what_is_not_a_number(override):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, [override])
    assert err.value.field == "warmup.train.optimizer.lr" and "expected a number" in str(err.value)
