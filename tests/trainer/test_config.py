"""Training config: YAML + overrides load into frozen dataclasses, and bad values raise a
ConfigError naming the field (dotted path) — including the model × grid cross-checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.trainer.config import TrainConfig, check_model_fits_parallel
from mcore_rl.trainer.lm import LMRunConfig

CONFIG = Path(__file__).parents[2] / "configs" / "lm_micro.yaml"


def test_lm_micro_yaml_loads():
    cfg = load_config(LMRunConfig, CONFIG)
    assert (cfg.model, cfg.steps, cfg.parallel.tp, cfg.parallel.world_size) == ("micro", 30, 2, 2)
    assert cfg.train.optimizer.lr == 3e-3 and cfg.train.dtype == "fp32"
    over = load_config(LMRunConfig, CONFIG, ["parallel.tp=1", "parallel.pp=2", "steps=5"])
    assert (over.parallel.tp, over.parallel.pp, over.steps) == (1, 2, 5)


@pytest.mark.parametrize("overrides,field,problem", [
    # micro: 4 heads, 2 kv heads, FFN 256, 4 layers.
    (["parallel.tp=3"], "parallel.tp", "does not divide num_attention_heads=4"),
    (["parallel.tp=4"], "parallel.tp", "does not divide num_key_value_heads=2"),
    (["parallel.tp=1", "parallel.pp=2", "parallel.vpp=4"], "parallel.pp",
     "pp * vpp = 8 does not divide num_layers=4"),
    (["parallel.tp=1", "parallel.pp=2", "parallel.first_stage_layers=3",
      "parallel.last_stage_layers=3"], "parallel.first_stage_layers", "do not split evenly"),
    (["parallel.sequence_parallel=true", "train.seq_len=31"], "train.seq_len",
     "divisible by parallel.tp=2"),
    (["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2", "train.num_micro_batches=3"],
     "train.num_micro_batches", "multiple of parallel.pp=2"),
    (["train.seq_len=300"], "train.seq_len", "max_position_embeddings=256"),
    (["train.optimizer.lrr=1"], "train.optimizer.lrr", "unknown field"),
    (["train.micro_batch_size=many"], "train.micro_batch_size", "expected an integer"),
    (["train.dtype=fp16"], "train.dtype", "allowed values: fp32, bf16"),
    (["train.optimizer.lr=0"], "train.optimizer.lr", "must be > 0"),
    (["train.optimizer.clip_grad=0"], "train.optimizer.clip_grad", "must be > 0"),
    (["train.optimizer.adam_beta2=1.0"], "train.optimizer.adam_beta2", "must be in [0, 1)"),
    (["model=gpt5"], "model", "unknown preset"),
    (["parallel.sequence_parallel=true", "parallel.tp=1"], "parallel.sequence_parallel",
     "needs tp > 1"),
])
def test_bad_config_names_the_field(overrides, field, problem):
    with pytest.raises(ConfigError) as err:
        load_config(LMRunConfig, CONFIG, overrides)
    assert err.value.field == field
    assert problem in str(err.value)


def test_cross_check_is_callable_alone():
    spec = get_preset("llama3-8b")  # 32 heads, 8 kv heads, 32 layers
    check_model_fits_parallel(spec, ParallelConfig(tp=8, pp=4, vpp=2))
    check_model_fits_parallel(spec, ParallelConfig(tp=8, pp=4), TrainConfig(seq_len=4096))
    with pytest.raises(ConfigError, match="parallel.tp=16: does not divide num_key_value_heads"):
        check_model_fits_parallel(spec, ParallelConfig(tp=16))


def test_cross_check_does_not_import_megatron():
    # A preflight can validate configs without the ~4 s megatron import.
    code = ("import sys, mcore_rl.trainer.config, mcore_rl.trainer.lm; "
            "sys.exit('megatron' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
