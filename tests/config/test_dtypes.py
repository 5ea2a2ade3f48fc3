"""One dtype vocabulary: every config field and flag takes torch's names or the short
spellings, is normalized to torch's name at load, and a bad value names its field."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.config import ConfigError, load_config
from mcore_rl.config.dtypes import dtype_bytes, dtype_name, torch_dtype
from mcore_rl.runconfig import RLConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.mark.parametrize("spelling,canonical,torch_type", [
    ("float32", "float32", torch.float32), ("fp32", "float32", torch.float32),
    ("bfloat16", "bfloat16", torch.bfloat16), ("bf16", "bfloat16", torch.bfloat16),
    ("float16", "float16", torch.float16), ("fp16", "float16", torch.float16),
])
def test_every_spelling_maps_to_torchs_name(spelling, canonical, torch_type):
    assert dtype_name(spelling, "x") == canonical
    assert torch_dtype(spelling) is torch_type
    assert dtype_bytes(spelling) == torch_type.itemsize


def test_rl_config_fields_are_normalized_at_load():
    cfg = load_config(RLConfig, None, ["train.dtype=bf16", "critic_train.dtype=bfloat16",
                                       "rollout.dtype=bf16", "sync.dtype=fp32",
                                       "reward_model.dtype=bf16"])
    assert (cfg.train.dtype, cfg.critic_train.dtype, cfg.rollout.dtype, cfg.sync.dtype,
            cfg.reward_model.dtype) == ("bfloat16",) * 3 + ("float32", "bfloat16")
    assert cfg.wire_dtype == "float32"
    auto = load_config(RLConfig, None, ["rollout.dtype=bf16"])
    assert auto.sync.dtype == "auto" and auto.wire_dtype == "bfloat16"


@pytest.mark.parametrize("override,field", [
    ("train.dtype=float16", "train.dtype"),          # megatron's fp16 path is not wired here
    ("train.dtype=fp8", "train.dtype"),
    ("rollout.dtype=half", "rollout.dtype"),
    ("sync.dtype=fp16", "sync.dtype"),
    ("reward_model.dtype=float64", "reward_model.dtype"),
])
def test_a_bad_dtype_names_its_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, [override])
    assert str(err.value).startswith(field), str(err.value)
