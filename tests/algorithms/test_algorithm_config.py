"""AlgorithmConfig validation names the field and the allowed values."""

import dataclasses

import pytest

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.config import ConfigError, load_config

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_defaults_are_valid_and_frozen():
    cfg = AlgorithmConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gamma = 0.5


@pytest.mark.parametrize("field,value,problem", [
    ("advantage_estimator", "ppo", "allowed values: gae, grpo, rloo, reinforce_pp"),
    ("loss_agg", "sum", "allowed values: token-mean, seq-mean-token-mean, seq-mean-token-sum"),
    ("kl_estimator", "k4", "allowed values: k1, k2, k3"),
    ("kl_mode", "both", "allowed values: loss, reward"),
    ("clip_eps_low", 1.0, "must be in [0, 1)"),
    ("clip_eps_high", -0.1, "must be >= 0"),
    ("clip_c", 1.0, "must be > 1"),
    ("entropy_coeff", -1.0, "must be >= 0"),
    ("kl_coeff", -0.1, "must be >= 0"),
    ("gamma", 1.5, "must be in [0, 1]"),
    ("lam", -0.1, "must be in [0, 1]"),
    ("value_clip", 0.0, "must be > 0"),
    ("grpo_eps", 0.0, "must be > 0"),
    ("overlong_buffer", -1, "must be >= 0"),
    ("overlong_penalty", -1.0, "must be >= 0"),
])
def test_invalid_values_name_the_field(field, value, problem):
    with pytest.raises(ConfigError) as err:
        AlgorithmConfig(**{field: value})
    assert err.value.field == field and err.value.value == value
    assert problem in err.value.problem


def test_loads_from_overrides():
    cfg = load_config(AlgorithmConfig, overrides=[
        "advantage_estimator=gae", "clip_c=null", "clip_eps_high=0.28", "dynamic_sampling=true",
        "overlong_buffer=4"])
    assert (cfg.advantage_estimator, cfg.clip_c, cfg.clip_eps_high) == ("gae", None, 0.28)
    assert cfg.dynamic_sampling and cfg.overlong_buffer == 4
    with pytest.raises(ConfigError, match="kl_estimator"):
        load_config(AlgorithmConfig, overrides=["kl_estimator=k9"])


@pytest.mark.parametrize("kl_mode,kl_coeff,folded", [
    ("reward", 0.1, True), ("reward", 0.0, False), ("loss", 0.1, False)])
def test_kl_in_reward_needs_the_reward_mode_and_a_coefficient(kl_mode, kl_coeff, folded):
    assert AlgorithmConfig(kl_mode=kl_mode, kl_coeff=kl_coeff).kl_in_reward is folded
