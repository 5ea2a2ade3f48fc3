"""Issue #30, C2: a worker computes on the device the run plan resolved for it, never on what
`torch.cuda.is_available()` says in its process. The training world's backend, the model's
host/device initialisation and the CPU shims of megatron-core all follow the device handed
in, so a plan that says "cuda:3" is obeyed on a machine where torch is unsure, and a CPU plan
stays on the host where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.compat import apply_cpu_compat
from mcore_rl.models.gpt import transformer_config_from_spec
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.parallel import groups
from mcore_rl.parallel.groups import backend_for, join_worker_world

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda:0", "nccl"),
                                             ("cuda:3", "nccl")])
def test_the_worlds_backend_follows_the_device(device, backend):
    assert backend_for(device) == backend


@pytest.mark.parametrize("device, cuda_here, on_host", [
    ("cpu", True, True),       # a CPU plan on a machine with CUDA stays on the host
    ("cuda:0", False, False),  # a CUDA plan is never turned into host initialisation
])
def test_the_model_config_follows_the_ranks_device(monkeypatch, device, cuda_here, on_host):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_here)
    config = transformer_config_from_spec(get_preset("micro"), ParallelConfig(), device=device)
    assert config.use_cpu_initialization is on_host
    # N15: no torch.cuda.synchronize() after each pipeline exchange, on any device
    assert config.batch_p2p_sync is False


def test_cpu_shims_are_not_installed_for_a_cuda_rank(monkeypatch):
    """A CUDA rank gets none of the CPU shims: only the shims of megatron-core's gaps without
    TransformerEngine (`WITHOUT_TE`), which are not about the device."""
    from mcore_rl.compat import megatron_cpu

    asked = []

    def apply(only=None):
        asked.append(only)
        if only is None or set(only) - set(megatron_cpu.WITHOUT_TE):
            raise AssertionError("megatron-core's CPU shims installed for a CUDA rank")
        return list(only)

    monkeypatch.setattr(megatron_cpu, "apply", apply)
    assert apply_cpu_compat("cuda:1") == ["moe_router_gemm"]
    assert asked == [["moe_router_gemm"]]
    with pytest.raises(AssertionError, match="CPU shims"):
        apply_cpu_compat("cpu")


def test_a_worker_joins_on_its_planned_device(monkeypatch):
    """join_worker_world makes a CUDA device current and joins over NCCL because the plan
    says so (recorded here; no GPU on this machine), before any store is contacted."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(groups, "reuse_freed_host_memory", lambda: calls.append("host memory"))

    class Joined(Exception):
        pass

    def store(*args, **kwargs):
        raise Joined

    monkeypatch.setattr(torch.distributed, "TCPStore", store)
    with pytest.raises(Joined):
        join_worker_world(0, 1, ("127.0.0.1", 1), ParallelConfig(), timeout_s=1.0,
                          device="cuda:3")
    assert calls == [("set_device", torch.device("cuda", 3))]
    calls.clear()
    with pytest.raises(Joined):
        join_worker_world(0, 1, ("127.0.0.1", 1), ParallelConfig(), timeout_s=1.0,
                          device="cpu")
    assert calls == []
    with pytest.raises(Joined):  # a CPU rank whose logits outgrow malloc's own reuse
        join_worker_world(0, 1, ("127.0.0.1", 1), ParallelConfig(), timeout_s=1.0,
                          device="cpu", largest_step_bytes=64 << 20)
    assert calls == ["host memory"]  # caches its freed buffers as CUDA's allocator does
