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
from mcore_rl.megatron.config import TrainConfig, check_model_fits_parallel
from mcore_rl.train_lm import LMRunConfig

CONFIG = Path(__file__).parents[2] / "configs" / "lm_micro.yaml"


def test_lm_micro_yaml_loads():
    cfg = load_config(LMRunConfig, CONFIG)
    assert (cfg.model, cfg.steps, cfg.actor.tp, cfg.actor.world_size) == ("micro", 30, 2, 2)
    assert cfg.train.optimizer.lr == 3e-3 and cfg.train.dtype == "float32"
    over = load_config(LMRunConfig, CONFIG, ["actor.tp=1", "actor.pp=2", "steps=5"])
    assert (over.actor.tp, over.actor.pp, over.steps) == (1, 2, 5)


@pytest.mark.parametrize("overrides,field,problem", [
    # micro: 4 heads, 2 kv heads, FFN 256, 4 layers.
    (["actor.tp=3"], "actor.tp", "does not divide num_attention_heads=4"),
    (["actor.tp=4"], "actor.tp", "does not divide num_key_value_heads=2"),
    (["actor.tp=1", "actor.pp=2", "actor.vpp=4"], "actor.pp",
     "pp * vpp = 8 does not divide num_layers=4"),
    (["actor.tp=1", "actor.pp=2", "actor.first_stage_layers=3",
      "actor.last_stage_layers=3"], "actor.first_stage_layers", "do not split evenly"),
    (["actor.sequence_parallel=true", "train.seq_len=31"], "train.seq_len",
     "divisible by actor.tp=2"),
    (["actor.tp=1", "actor.pp=2", "actor.vpp=2", "train.num_micro_batches=3"],
     "train.num_micro_batches", "multiple of actor.pp=2"),
    (["train.seq_len=300"], "train.seq_len", "max_position_embeddings=256"),
    (["train.optimizer.lrr=1"], "train.optimizer.lrr", "unknown field"),
    (["train.micro_batch_size=many"], "train.micro_batch_size", "expected an integer"),
    (["train.dtype=fp16"], "train.dtype", "must be one of float32 (fp32), bfloat16 (bf16)"),
    (["train.optimizer.lr=0"], "train.optimizer.lr", "must be > 0"),
    (["train.optimizer.clip_grad=0"], "train.optimizer.clip_grad", "must be > 0"),
    (["train.optimizer.adam_beta2=1.0"], "train.optimizer.adam_beta2", "must be in [0, 1)"),
    (["model=gpt5"], "model", "unknown preset"),
    (["actor.sequence_parallel=true", "actor.tp=1"], "actor.sequence_parallel",
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
    with pytest.raises(ConfigError, match="actor.tp=16: does not divide num_key_value_heads"):
        check_model_fits_parallel(spec, ParallelConfig(tp=16))
    # the grid named as its config calls it (the reward model's is reward_model.parallel)
    with pytest.raises(ConfigError, match="reward_model.parallel.tp=16: does not divide"):
        check_model_fits_parallel(spec, ParallelConfig(tp=16), grid="reward_model.parallel")


def test_train_lm_grid_moved_to_actor():
    """train-lm names its grid as the RL run config does; the old key says where it went."""
    with pytest.raises(ConfigError) as err:
        load_config(LMRunConfig, CONFIG, ["parallel.tp=1"])
    assert err.value.field == "parallel" and "moved: actor (the training grid" in str(err.value)


def test_cross_check_does_not_import_megatron():
    # A preflight can validate configs without the ~4 s megatron import.
    code = ("import sys, mcore_rl.megatron.config, mcore_rl.train_lm; "
            "sys.exit('megatron' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# --- the RL run config ------------------------------------------------------------------------

ROOT = Path(__file__).parents[2]
RL_CONFIGS = sorted(p for p in [*ROOT.glob("configs/*.yaml"), *ROOT.glob("configs/gpu/*.yaml")]
                    if p.name != "lm_micro.yaml")  # lm_micro is `mcore-rl train-lm`'s


def test_every_shipped_rl_config_loads():
    from mcore_rl.runconfig import RLConfig

    assert {p.name for p in RL_CONFIGS} >= {"grpo_addition.yaml", "ppo_addition.yaml",
                                            "tiny_ci.yaml", "llama3-8b.yaml", "llama2-13b.yaml",
                                            "llama3-70b.yaml", "tool_calc.yaml",
                                            "grpo_jsonl.yaml"}
    for path in RL_CONFIGS:
        cfg = load_config(RLConfig, path)
        if path.parent.name == "gpu":  # checkpoint + preset, GSM8K, bf16, sized for GPUs
            assert cfg.model.hf_dir and cfg.model.preset, path
            assert (cfg.task.kind, cfg.task.reward_path) == (
                "jsonl", "mcore_rl.tasks.math:answer_reward"), path
            assert cfg.train.dtype == "bfloat16" and cfg.rollout.dtype == "bfloat16", path
            assert cfg.cluster.device == "gpu", path
        elif path.name == "grpo_jsonl.yaml":  # the worked example: your checkpoint and data
            assert cfg.model.hf_dir and cfg.model.preset is None, path
            assert (cfg.task.kind, cfg.task.path) == (
                "jsonl", "configs/data/word_problems.jsonl"), path
            assert cfg.cluster.device == "local", path
        else:  # the demo: addition task, built model, this machine
            assert cfg.model.hf_dir is None, path
            assert cfg.task.kind in ("addition", "tool_calc"), path
            assert cfg.cluster.device == "local", path


def test_demo_default_is_addition_on_the_built_model():
    from mcore_rl.runconfig import RLConfig

    cfg = load_config(RLConfig)
    assert (cfg.task.kind, cfg.task.digits, cfg.task.reward_path) == (
        "addition", 2, "mcore_rl.tasks.addition:reward")
    assert cfg.model.hf_dir is None and cfg.model.planning_model().vocab == 16
    assert cfg.train.recompute == "none"


@pytest.mark.parametrize("overrides,field,problem", [
    (["task.kind=csv"], "task.kind", "allowed values: addition, jsonl, tool_calc"),
    (["task.digits=0"], "task.digits", "must be in [1, 18]"),
    (["task.reward_fn=math:sqrt"], "task.reward_fn", "must accept (prompt, response, answer)"),
    (["task.kind=jsonl"], "task.path", "needs a JSONL file"),
    (["task.kind=jsonl", "task.path=/data/x.jsonl", "model.hf_dir=/m"], "warmup.max_steps",
     "has no supervised targets"),
    (["task.kind=jsonl", "task.path=/data/x.jsonl", "warmup.max_steps=0"], "model.hf_dir",
     "needs an HF checkpoint"),
    (["model.preset=gpt5", "model.hf_dir=/m"], "model.preset", "unknown preset"),
    (["model.preset=llama3-8b"], "model.preset", "set hf_dir too"),
    (["model.hidden=100"], "model.hidden", ">= 32 (vLLM CPU attention)"),
    (["model.kv_heads=3"], "model.kv_heads", "must divide heads=4"),
    (["cluster.nodes=0"], "cluster.nodes", "must be >= 1"),
    (["cluster.nodes=2"], "cluster.device", "set device gpu or cpu"),
    (["cluster.placement=hybrid"], "cluster.placement", "allowed values"),
    (["cluster.device=gpu", "cluster.placement=colocated"], "rollout.enable_sleep",
     "the engines must sleep"),
    (["train.recompute=some"], "train.recompute", "allowed values: none, selective, full"),
    (["digits=3"], "digits", "unknown field"),          # moved to task.digits
    (["reward_fn=x:y"], "reward_fn", "unknown field"),  # moved to task.reward_fn
])
def test_bad_rl_config_names_the_field(overrides, field, problem):
    from mcore_rl.runconfig import RLConfig

    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, ROOT / "configs" / "grpo_addition.yaml", overrides)
    assert err.value.field == field
    assert problem in str(err.value)


def test_gpu_config_without_weights_or_preset_names_the_fix():
    from mcore_rl.runconfig import RLConfig

    cfg = load_config(RLConfig, ROOT / "configs" / "gpu" / "llama3-8b.yaml", ["model.preset=null"])
    with pytest.raises(ConfigError, match="set model.preset to the planner preset"):
        cfg.model.planning_model()
    assert load_config(RLConfig, ROOT / "configs" / "gpu" / "llama3-8b.yaml"
                       ).model.planning_model() == "llama3-8b"


def test_sync_backend_defaults_to_the_devices_own():
    """sync.backend null: the resolved device's own; set, it is checked against the device
    (preflight), also on a "local" cluster. The weight sync's settings sit in one section:
    a key from where they were before is refused naming its new place."""
    from mcore_rl.runconfig.resolve import resolve_run
    from mcore_rl.runconfig import RLConfig

    grpo = ROOT / "configs" / "grpo_addition.yaml"
    assert load_config(RLConfig, grpo).sync.backend is None
    cfg = load_config(RLConfig, grpo, ["sync.backend=gloo"])
    assert resolve_run(cfg, assume_gpu=True, cuda_available=False).sync_backend == "gloo"
    with pytest.raises(ConfigError, match="allowed values: nccl, gloo"):
        load_config(RLConfig, grpo, ["sync.backend=mpi"])
    for old, new in (("cluster.sync_backend=gloo", "sync.backend"),
                     ("sync_bucket_mb=64", "sync.bucket_mb"), ("sync_dtype=bf16", "sync.dtype")):
        with pytest.raises(ConfigError) as err:
            load_config(RLConfig, grpo, [old])
        assert err.value.field == old.split("=")[0]
        assert str(err.value).endswith(f"this key moved: set {new}")
    # `warmup` is the supervised warm-up only: the learning rate's is lr_warmup_steps
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, grpo, ["train.optimizer.warmup_steps=5"])
    assert err.value.field == "train.optimizer.warmup_steps"
    assert "this key moved: set lr_warmup_steps" in str(err.value)
    assert load_config(RLConfig, grpo, ["train.optimizer.lr_warmup_steps=5"]).train.optimizer \
        .lr_warmup_steps == 5


def test_demo_model_moe_is_a_qwen3_moe_on_an_expert_parallel_actor():
    """`mcore-rl demo --model moe`: the addition demo's config with a demo Qwen3-MoE, EP2."""
    import argparse

    from mcore_rl.run.train import _config_path
    from mcore_rl.runconfig import RLConfig

    args = argparse.Namespace(config=None, task=None, model="moe")
    cfg = load_config(RLConfig, _config_path(args))
    spec = cfg.model.demo_spec()
    assert (spec.family, spec.num_experts, spec.experts_per_token, spec.moe_ffn) == (
        "qwen3_moe", 4, 2, 128) and spec.qk_norm
    assert (cfg.actor.ep, cfg.actor.world_size) == (2, 2)
    check_model_fits_parallel(spec, cfg.actor, cfg.train)
    assert _config_path(argparse.Namespace(config=None, task=None, model="dense")) == \
        ROOT / "configs" / "grpo_addition.yaml"
    with pytest.raises(ConfigError, match="runs the addition task"):
        _config_path(argparse.Namespace(config=None, task="tool_calc", model="moe"))
    with pytest.raises(ConfigError, match="experts_per_token"):
        load_config(RLConfig, None, ["model.experts=2", "model.experts_per_token=3"])
