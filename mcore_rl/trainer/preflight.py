"""Preflight of an RL run: the run's config (`RLConfig`) mapped onto the planner's internal
`RunShape`, so the same checks `mcore-rl preflight` runs (grid vs model, vLLM TP, executor and
sync backend, memory) run automatically before `mcore-rl train` / `demo` start any worker —
and their messages name the fields of the RLConfig YAML (`actor.tp`, `cluster.nodes`, ...).

What is sized: the model as `ModelConfig.planning_model` says (the demo spec, hf_dir's
config.json, or the preset when the checkpoint is not on this machine); the devices as
`cfg.cluster` says (this machine for device "local").
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import torch

from mcore_rl.config import ConfigError, load_config
from mcore_rl.planning.preflight import Problem, format_problems, preflight
from mcore_rl.planning.run_shape import RewardShape, RolloutShape, RunShape, TrainShape
from mcore_rl.trainer.rl_config import RLConfig


class PreflightFailed(RuntimeError):
    """The run cannot work as configured; the message lists every problem with its fix."""


# RunShape field → how the RLConfig YAML spells it. Bare top-level names are renamed only
# where a text uses them as a field (followed by =, <=, ×, ...), not in prose ("spans nodes").
_DOTTED = [
    (r"train\.parallel\.", "actor."), (r"train\.parallel\b", "actor"),
    (r"parallel\.", "actor."),  # megatron-grid errors say parallel.tp
    (r"train\.global_batch_size", "prompts_per_step·samples_per_prompt/updates_per_batch"),
    (r"train\.grad_dtype=bf16", "bf16 grads (planner-only: the trainer reduces grads in fp32)"),
    (r"rollout\.sleep=all", "rollout.enable_sleep=true"),
    (r"rollout\.sleep\b", "rollout.enable_sleep"),
    (r"rollout\.executor=(mp|uni|ray)",
     r"rollout.tp (the executor follows it: uni at tp 1, mp above)"),
    (r"rollout\.max_num_batched_tokens", "vLLM's max_num_batched_tokens (planner default)"),
]
_TOP = ("nodes", "gpus_per_node", "device_gib", "reserve_gib", "placement", "sync_backend",
        "device")
_RENAMES = [(re.compile(r"(?<![\w.])" + pat), rep) for pat, rep in _DOTTED] + [
    (re.compile(rf"(?<![\w.]){name}(?=\s*(?:=|<=|>=|<|>|×))"), f"cluster.{name}")
    for name in _TOP]


def rl_field_names(text: str) -> str:
    """`text` (a preflight message, fix or plan) with RunShape field names spelled as the
    RLConfig YAML spells them."""
    for pattern, replacement in _RENAMES:
        text = pattern.sub(replacement, text)
    return text


def _renamed(problems: list[Problem]) -> list[Problem]:
    return [Problem(p.check, rl_field_names(p.message), rl_field_names(p.fix), p.severity)
            for p in problems]


def _hardware(cfg: RLConfig) -> dict:
    """RunShape's hardware fields: the cluster section, or this machine."""
    c = cfg.cluster
    if c.device != "local":
        return {"device": c.device, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
                "device_gib": c.device_gib, "reserve_gib": c.reserve_gib,
                "placement": c.placement, "sync_backend": c.sync_backend}
    # On CPU every worker is a process on this machine: the "devices" are the actor ranks
    # plus the engines' TP workers, and the device memory is the machine's.
    on_gpu = torch.cuda.is_available()
    devices = cfg.actor.world_size + cfg.rollout.tp * cfg.rollout.engines
    memory = (torch.cuda.get_device_properties(0).total_memory if on_gpu
              else psutil.virtual_memory().total)
    return {"device": "gpu" if on_gpu else "cpu", "nodes": 1,
            "gpus_per_node": torch.cuda.device_count() if on_gpu else devices,
            "device_gib": memory / 2**30, "reserve_gib": 3.0 if on_gpu else 0.0,
            "placement": "disaggregated", "sync_backend": "nccl" if on_gpu else "gloo"}


def run_shape_of(cfg: RLConfig, model_dir: str | Path | None = None) -> RunShape:
    """The resources and shapes this RL run will use, as the planner describes a run.
    `model_dir`: the model directory the run will load (the built demo model); None sizes
    from `cfg.model.planning_model()` (raises ConfigError when there is nothing to size)."""
    hw = _hardware(cfg)
    on_gpu = hw["device"] == "gpu"
    batch = cfg.prompts_per_step * cfg.samples_per_prompt
    return RunShape(
        model=str(model_dir) if model_dir is not None else cfg.model.planning_model(), **hw,
        train=TrainShape(parallel=cfg.actor, micro_batch_size=cfg.train.micro_batch_size,
                         global_batch_size=batch // cfg.updates_per_batch,
                         seq_len=cfg.train.seq_len, dtype=cfg.train.dtype,
                         grad_dtype="fp32",  # megatron_train reduces grads in fp32
                         recompute=cfg.train.recompute,
                         critic=cfg.algorithm.advantage_estimator == "gae",
                         reference=cfg.algorithm.kl_coeff > 0,
                         kernels="te" if on_gpu else "local"),
        rollout=RolloutShape(tp=cfg.rollout.tp, engines=cfg.rollout.engines,
                             dtype=cfg.rollout.dtype,
                             gpu_memory_utilization=(cfg.rollout.gpu_memory_utilization
                                                     if on_gpu else None),
                             max_num_seqs=cfg.rollout.max_num_seqs or 256,
                             executor="uni" if cfg.rollout.tp == 1 else "mp",
                             sleep="all" if cfg.rollout.enable_sleep else "none"),
        reward_model=_reward_shape(cfg),
    )


def _reward_shape(cfg: RLConfig) -> RewardShape | None:
    rm = cfg.reward_model
    if not rm.enabled:
        return None
    return RewardShape(model=rm.planning_model(), parallel=rm.parallel, dtype=rm.dtype,
                       micro_batch_size=rm.micro_batch_size)


def _preset_mismatch(cfg: RLConfig) -> list[Problem]:
    """A warning when model.preset and hf_dir's config.json are both here and differ."""
    m = cfg.model
    if m.preset is None or m.hf_dir is None or not (Path(m.hf_dir) / "config.json").is_file():
        return []
    from mcore_rl.models.presets import PRESETS
    from mcore_rl.models.spec import ModelSpec

    if ModelSpec.from_hf_dir(m.hf_dir) == PRESETS[m.preset]:
        return []
    return [Problem("model-preset", f"model.preset={m.preset} differs from {m.hf_dir}/config.json "
                    "(preflight used the checkpoint)", "model.preset naming the checkpoint's "
                    "shapes, or null", "warning")]


def preflight_run(cfg: RLConfig, model_dir: str | Path | None = None) -> list[Problem]:
    """Every problem of the run (errors and warnings), named as in the RLConfig YAML."""
    try:
        shape = run_shape_of(cfg, model_dir)
    except ConfigError as err:
        return [Problem("model", str(err), f"fix {err.field}")]
    return _renamed(preflight(shape)) + _preset_mismatch(cfg)


def preflight_config(path: str | Path, overrides: list[str] | None = None
                     ) -> tuple[RLConfig | None, list[Problem]]:
    """Load and check an RLConfig YAML. A config that does not load is one problem."""
    try:
        cfg = load_config(RLConfig, path, overrides)
    except ConfigError as err:
        return None, [Problem("config", str(err), f"fix {err.field} in {path}")]
    return cfg, preflight_run(cfg)


def check_run(cfg: RLConfig, model_dir: str | Path | None = None) -> list[Problem]:
    """Raise PreflightFailed listing every error; return the warnings."""
    problems = preflight_run(cfg, model_dir)
    if any(p.severity == "error" for p in problems):
        raise PreflightFailed("preflight found problems:\n" + format_problems(problems))
    return problems


__all__ = ["PreflightFailed", "check_run", "preflight_config", "preflight_run",
           "rl_field_names", "run_shape_of"]
