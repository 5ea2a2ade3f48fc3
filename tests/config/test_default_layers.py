"""Two layers of defaults: a config dataclass's own field defaults, then the YAML (and CLI
overrides). A section's default is its class's default instance — never an instance built with
other values inside the owning config (`field(default_factory=lambda: TrainConfig(lr=...))`):
a config whose defaults differ is a class of its own (`CriticTrainConfig`, `LMTrainConfig`)."""

from __future__ import annotations

import pytest

import dataclasses
import typing

from mcore_rl.config import load_config, to_dict
from mcore_rl.megatron.config import OptimizerConfig, TrainConfig
from mcore_rl.runconfig import CriticOptimizerConfig, CriticTrainConfig, RLConfig
from mcore_rl.train_lm import LMOptimizerConfig, LMRunConfig, LMTrainConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

CONTAINERS = (list, dict, tuple, set)


def config_classes(cls: type, seen: set[type] | None = None) -> set[type]:
    """`cls` and every config dataclass its fields hold, recursively."""
    seen = set() if seen is None else seen
    if cls in seen:
        return seen
    seen.add(cls)
    for hint in typing.get_type_hints(cls).values():
        for arg in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                config_classes(arg, seen)
    return seen


def test_every_section_default_is_its_own_class_default():
    for owner in config_classes(RLConfig) | config_classes(LMRunConfig):
        hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(owner):
            factory = f.default_factory
            if factory is dataclasses.MISSING or factory in CONTAINERS:
                continue
            assert factory is hints[f.name], (
                f"{owner.__name__}.{f.name}: default_factory={factory!r} builds something other "
                f"than its type's defaults: give the defaults a dataclass of their own")


def test_critic_train_defaults():
    critic = RLConfig().critic_train
    assert isinstance(critic, CriticTrainConfig) and isinstance(critic, TrainConfig)
    assert critic.optimizer.lr == CriticOptimizerConfig().lr == 1e-5
    assert RLConfig().train.optimizer.lr == OptimizerConfig().lr == 1e-6
    # but for the learning rate, the critic's step and optimizer are the actor's
    assert to_dict(CriticTrainConfig()) == {
        **to_dict(TrainConfig()), "optimizer": {**to_dict(OptimizerConfig()), "lr": 1e-5}}


def test_critic_lr_survives_a_partial_section():
    cfg = load_config(RLConfig, None, ["critic_train.micro_batch_size=8",
                                       "critic_train.optimizer.min_lr=1e-7"])
    assert cfg.critic_train.optimizer.lr == 1e-5
    assert (cfg.critic_train.micro_batch_size, cfg.critic_train.optimizer.min_lr) == (8, 1e-7)
    assert isinstance(cfg.critic_train, CriticTrainConfig)


def test_train_lm_defaults():
    train = LMRunConfig().train
    assert isinstance(train, LMTrainConfig) and isinstance(train.optimizer, LMOptimizerConfig)
    assert (train.micro_batch_size, train.num_micro_batches, train.seq_len) == (4, 2, 32)
    assert train.optimizer.lr == 1e-3
    assert to_dict(train) == {**to_dict(TrainConfig()), "micro_batch_size": 4,
                              "num_micro_batches": 2, "seq_len": 32,
                              "optimizer": {**to_dict(OptimizerConfig()), "lr": 1e-3}}
    cfg = load_config(LMRunConfig, None, ["train.seq_len=16", "train.optimizer.min_lr=1e-4"])
    assert (cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.optimizer.lr) == (16, 4, 1e-3)
