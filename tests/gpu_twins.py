"""GPU checks and their CPU twins: one test body, run with device "cpu" everywhere and again
with device "cuda" (marked `gpu`).

`device_params(twin)` parametrizes a test over both; without CUDA the "cuda" case skips with a
reason naming its CPU twin, which runs here. `scripts/gpu_check.sh` runs `pytest -m gpu` on a
machine with one GPU, so everything here fits on one device: several ranks of a test share
cuda:0 and talk over gloo (NCCL refuses two ranks of a group on one device); a one-rank world
uses NCCL.

Spawned ranks start from `spawn_env(device)` and `join_world(rank, world, device)`: a "cpu" rank
hides CUDA (`CUDA_VISIBLE_DEVICES=""`, read at CUDA's first use, after the env is applied), so
its megatron-core runs with the CPU compat shims exactly as on a CPU-only machine — the fp32
CPU references of the GPU checks come from the same code on the GPU machine itself.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def gpu_marks(twin: str) -> list:
    """`gpu` plus a skip without CUDA that names the CPU twin (a pytest node id)."""
    return [pytest.mark.gpu,
            pytest.mark.skipif(not cuda_available(),
                               reason=f"needs a CUDA device; its CPU twin {twin} runs the "
                                      "same code with device 'cpu'")]


def importable(name: str) -> bool:
    """Whether `name` imports here, without importing it (False too where an import hook
    refuses it, as a machine without the package would)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def vllm_gpu_marks(twin: str) -> list:
    """`gpu_marks` for a check that runs vLLM on the GPU: it also needs vLLM and mcore-rl's
    vLLM plugin (the package installed, so vLLM's workers find its entry point; a
    VLLM_PLUGINS allow-list naming it). The GPU check machine has CUDA but neither, so there
    the check skips naming what is missing, rather than failing at the engine's start."""
    from mcore_rl.rollout.vllm_plugin import plugin_missing

    lacking = [what for what, there in (
        ("a CUDA device", cuda_available()),
        ("vLLM (not importable)", importable("vllm"))) if not there]
    plugin = plugin_missing()
    if plugin is not None:
        lacking.append(plugin.problem)
    return [pytest.mark.gpu,
            pytest.mark.skipif(bool(lacking), reason=f"needs {'; '.join(lacking)}; its CPU twin "
                                                     f"{twin} runs the same path")]


def device_params(twin: str) -> list:
    """`@pytest.mark.parametrize("device", device_params("<file>::<test>[cpu]"))`."""
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=gpu_marks(twin))]


def spawn_env(device: str) -> dict[str, str]:
    """Env of the spawned ranks: a "cpu" rank sees no CUDA, whatever the machine has."""
    return {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}


def join_world(rank: int, world: int, device: str) -> torch.device:
    """The default process group for a rank spawned with `init_default_group=False`: NCCL for a
    one-rank CUDA world, gloo otherwise (CUDA ranks share cuda:0). Returns the rank's device."""
    import torch.distributed as dist

    from mcore_rl.parallel.world import join_default_group

    if device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device == "cuda" and world == 1 else "gloo"
    store = dist.TCPStore("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]), world + 1,
                          is_master=False, timeout=datetime.timedelta(seconds=60))
    join_default_group(backend, store=store, rank=rank, world_size=world,
                       timeout=datetime.timedelta(seconds=120))
    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
