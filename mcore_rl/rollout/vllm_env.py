"""The process environment vLLM reads, set before an engine starts (vLLM takes its settings
from the environment, so this is process-wide; one live engine per process).

On CPU the legacy integer-GiB `VLLM_CPU_KVCACHE_SPACE` would override the engine's
`kv_cache_memory_bytes` and is removed; tp > 1 pins each rank's OpenMP threads
(`VLLM_CPU_OMP_THREADS_BIND`). `vllm.envs` caches env reads, so the cache is cleared before
each engine starts.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from mcore_rl.rollout.config import RolloutConfig


def _allowed_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def _threads_bind(cfg: RolloutConfig) -> str:
    if cfg.cpu_threads_bind:
        return cfg.cpu_threads_bind
    cores = _allowed_cores()
    per = max(1, len(cores) // cfg.tp)
    return "|".join(",".join(str(cores[(r * per + i) % len(cores)]) for i in range(per))
                    for r in range(cfg.tp))


def configure_vllm_env(cfg: RolloutConfig, on_cpu: bool, routed_experts: bool = False) -> None:
    """Set the environment vLLM reads (process-wide; call before creating the engine).
    routed_experts: the engine returns each token's experts, which vLLM's V2 model runner
    alone captures — asked for by name, so vLLM fails at start-up where it cannot run it
    instead of choosing its V1 runner."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if routed_experts:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    # a multi-node launcher sets each node's own address; one machine uses cfg.host_ip
    os.environ["VLLM_HOST_IP"] = os.environ.get("MCORE_RL_NODE_IP") or cfg.host_ip
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # engines load local folders only
    if on_cpu:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes
        if cfg.tp > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _threads_bind(cfg)
    try:  # vLLM caches env reads once an engine has started; a new engine must re-read them
        from vllm import envs  # lazy: vllm
        envs.disable_envs_cache()
    except ImportError:  # pragma: no cover
        pass


# An engine process whose idle OpenMP threads sleep at once instead of spinning (the default
# spins a while after each parallel region). OpenMP reads it when torch loads it, so it goes
# where the process starts (a Ray actor's runtime_env); the thread count is set at start-up.
IDLE_THREADS_SLEEP = {"OMP_WAIT_POLICY": "PASSIVE"}


def engine_actor_env(cfg: RolloutConfig) -> dict[str, str]:
    """The environment an engine's Ray actor starts with, for its OpenMP threads. An engine
    that generates while the ranks train (mode one_step or async) and sets its own thread
    count (`in_process_threads`) gets `IDLE_THREADS_SLEEP`: its threads would otherwise spin
    between parallel regions on the cores the ranks train on. With mode sync the ranks wait
    while the engine generates: OpenMP's default (a short spin, then sleep) keeps each of the
    decode step's many small regions from waiting for its threads to wake up."""
    if cfg.in_process_threads is not None and cfg.mode != "sync":
        return dict(IDLE_THREADS_SLEEP)
    return {}


@contextmanager
def compiler_off(off: bool) -> Iterator[None]:
    """With `off` (unless `rollout.compile` asks for compilation: nothing compiled unless asked),
    torch.compile runs functions as written inside the block, here and in the TP worker
    processes started inside it (`TORCH_COMPILE_DISABLE`, read when they import torch).

    Why: vLLM's sampler compiles helpers with torch.compile even in eager mode — the log-prob
    ranks (`batched_count_greater_than`), top-k/top-p — on their first call. On CPU inductor
    builds a C++ kernel there, and the first time in a venv a large precompiled header: a
    visible share of a run's first generation, most of it on a fresh set-up."""
    if not off:
        yield
        return
    import torch._dynamo  # lazy: torch

    saved = os.environ.get("TORCH_COMPILE_DISABLE")
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_COMPILE_DISABLE", None)
        else:
            os.environ["TORCH_COMPILE_DISABLE"] = saved


@contextmanager
def model_inspected_in_process(on_cpu: bool) -> Iterator[None]:
    """On CPU, vLLM inspects the model class (which architecture, is it multimodal, ...) in this
    process instead of a fresh Python subprocess, inside the block.

    Why: the first time an architecture is seen under a `VLLM_CACHE_ROOT` (every fresh machine,
    container or SLURM node) `LLM()` runs `python -m vllm.model_executor.models.registry`,
    which imports torch and vLLM again just to import the model module — several times the
    in-process import, which is paid anyway when the engine loads the model a second later.
    vLLM spawns it so that the model import cannot initialize CUDA in a process that forks
    GPU workers; a CPU engine has no CUDA to initialize, so on GPU vLLM's subprocess is kept.
    The result still goes to vLLM's model-info cache. Pinned to vLLM 0.32
    (`registry._run_in_subprocess`); a vLLM without it keeps its own behaviour."""
    if not on_cpu:  # pragma: no cover - GPU only
        yield
        return
    from vllm.model_executor.models import registry  # lazy: vllm

    saved = getattr(registry, "_run_in_subprocess", None)
    if saved is None:  # pragma: no cover - another vLLM version
        yield
        return
    registry._run_in_subprocess = _call_here
    try:
        yield
    finally:
        registry._run_in_subprocess = saved


def _call_here(fn):
    return fn()


__all__ = ["IDLE_THREADS_SLEEP", "compiler_off", "configure_vllm_env", "engine_actor_env",
           "model_inspected_in_process"]
