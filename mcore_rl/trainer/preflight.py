"""Preflight of an RL run: the run's config mapped onto the planner's `RunShape`, so the same
checks `mcore-rl preflight` runs (grid vs model, vLLM TP, executor and sync backend, memory)
run automatically before `mcore-rl train` / `demo` start any worker."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from mcore_rl.planning.preflight import Problem, format_problems, preflight
from mcore_rl.planning.run_shape import RolloutShape, RunShape, TrainShape
from mcore_rl.trainer.rl_config import RLConfig


class PreflightFailed(RuntimeError):
    """The run cannot work as configured; the message lists every problem with its fix."""


def run_shape_of(cfg: RLConfig, model_dir: str | Path) -> RunShape:
    """The resources and shapes this RL run will use, as the planner describes a run.
    On CPU every worker is a process on this machine, so the "devices" are the actor ranks
    plus the engines' TP workers, and the device memory is the machine's."""
    on_gpu = torch.cuda.is_available()
    batch = cfg.prompts_per_step * cfg.samples_per_prompt
    devices = cfg.actor.world_size + cfg.rollout.tp * cfg.rollout.engines
    return RunShape(
        model=str(model_dir), device="gpu" if on_gpu else "cpu", nodes=1,
        gpus_per_node=(torch.cuda.device_count() if on_gpu else devices),
        device_gib=(torch.cuda.get_device_properties(0).total_memory if on_gpu
                    else psutil.virtual_memory().total) / 2**30,
        reserve_gib=0.0 if not on_gpu else 3.0,
        placement="disaggregated", sync_backend="nccl" if on_gpu else "gloo",
        train=TrainShape(parallel=cfg.actor, micro_batch_size=cfg.train.micro_batch_size,
                         global_batch_size=batch // cfg.updates_per_batch,
                         seq_len=cfg.train.seq_len, dtype=cfg.train.dtype,
                         critic=cfg.algorithm.advantage_estimator == "gae",
                         reference=cfg.algorithm.kl_coeff > 0,
                         kernels="te" if on_gpu else "local"),
        rollout=RolloutShape(tp=cfg.rollout.tp, engines=cfg.rollout.engines,
                             dtype=cfg.rollout.dtype,
                             gpu_memory_utilization=(cfg.rollout.gpu_memory_utilization
                                                     if on_gpu else None),
                             max_num_seqs=cfg.rollout.max_num_seqs or 256,
                             executor="uni" if cfg.rollout.tp == 1 else "mp", sleep="none"),
    )


def check_run(cfg: RLConfig, model_dir: str | Path) -> list[Problem]:
    """Raise PreflightFailed listing every error; return the warnings."""
    problems = preflight(run_shape_of(cfg, model_dir))
    if any(p.severity == "error" for p in problems):
        raise PreflightFailed("preflight found problems:\n" + format_problems(problems))
    return problems


__all__ = ["PreflightFailed", "check_run", "run_shape_of"]
