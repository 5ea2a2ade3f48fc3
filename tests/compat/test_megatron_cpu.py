"""Each CPU shim of mcore_rl.compat.megatron_cpu: upstream megatron-core fails on CPU without it
(so the shim is still needed) and works with it (so it is still applied and does the right
thing). When a megatron-core upgrade fixes one, its "needed" assertion fails: drop the shim.

All probes run in one spawned process — applying the shims changes that process for good, and
megatron stays out of the pytest process.
"""

from __future__ import annotations

import re

import pytest
import torch

from mcore_rl.launch.spawn import run_on_ranks

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

SHIMS = ("cuda_to_cpu_mode", "current_device", "default_causal_mask", "rng_get_state",
         "rng_set_state", "rng_tracker_add", "fp16_optimizer_type_check",
         "distrib_optimizer_type_check", "clip_grad_type_check", "torch_norm_sequence_parallel",
         "checkpoint_preload_sync", "moe_router_gemm", "moe_alltoall_streams")


# --- probes: each exercises the upstream code one shim is for and returns what it observed ----


def _device_literal():
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    return ConstantGradScaler(2.0).scale.device.type  # torch.tensor(..., device='cuda')



def _in_backward(fn):
    """fn() run inside a backward pass (where torch function modes are not active)."""
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            try:
                seen["value"] = fn()
            except Exception as err:  # noqa: BLE001 — re-raised outside the engine
                seen["error"] = err
            return grad

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    if "error" in seen:
        raise seen["error"]
    return seen["value"]


def _causal_mask_in_backward():
    # Activation recompute rebuilds the mask inside backward; fused_softmax holds its own name.
    from megatron.core.fusions import fused_softmax

    mask = _in_backward(lambda: fused_softmax.get_default_causal_mask(3))
    return mask.device.type, mask.tolist()


def _current_device():
    from megatron.core.utils import GlobalMemoryBuffer

    return GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe").device.type


def _rng_get_state():
    from megatron.core.tensor_parallel import random as tp_random

    torch.manual_seed(7)
    return torch.equal(tp_random._get_cuda_rng_state(), torch.get_rng_state())


def _rng_set_state():
    from megatron.core.tensor_parallel import random as tp_random

    state = torch.Generator().manual_seed(11).get_state()
    tp_random._set_cuda_rng_state(state)
    return torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(11)))


def _rng_tracker():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("probe", 5)
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork("probe"):
        drawn = torch.rand(3)
    expected = torch.rand(3, generator=torch.Generator().manual_seed(5))
    # The forked draw uses the tracked seed; the default stream is left where it was.
    return torch.equal(drawn, expected), torch.equal(torch.get_rng_state(), outside)


def _fp16_optimizer():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = Float16OptimizerWithFloat16Params(torch.optim.Adam([param]),
                                            OptimizerConfig(bf16=True, lr=1.0), None, None)
    return opt.fp32_from_float16_groups[0][0].dtype == torch.float32


def _distrib_optimizer():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    param = torch.nn.Parameter(torch.ones(6))
    gbuf_ranges = [{torch.float32: [{"param_map": {param: {"param": Range(2, 6)}}}]}]
    groups = DistributedOptimizer._build_model_and_main_param_groups(
        gbuf_ranges, {param: (0, torch.float32, 0)},
        [{"params": [param], "orig_group": {"params": [param]}}], OptimizerConfig(lr=1.0))
    model_fp32, shard_fp32 = groups[1], groups[3]
    return model_fp32[0] == [param] and shard_fp32[0][0].numel() == 4


def _clip_grad():
    from megatron.core.optimizer import clip_grads, optimizer

    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), 2.0)
    # Both references: optimizer.py imported the function by name.
    for clip in (clip_grads.clip_grad_by_total_norm_fp32,
                 optimizer.clip_grad_by_total_norm_fp32):
        clip([param], max_norm=1.0, total_norm=4.0)  # scales by 1 / (4 + 1e-6)
    return [round(g, 5) for g in param.grad.tolist()]


def _torch_norm_sp():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def config(sp):
        return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                 normalization="RMSNorm", sequence_parallel=sp,
                                 tensor_model_parallel_size=2 if sp else 1)

    sp_norm = WrappedTorchNorm(config(True), 8)
    plain = WrappedTorchNorm(config(False), 8)
    return (type(sp_norm).__name__, sp_norm.weight.sequence_parallel,
            plain.weight.sequence_parallel)


def _checkpoint_preload():
    # what dist_checkpointing.save runs before writing each rank's files
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    buckets = [("f", "k", ([], [("item", torch.arange(3.0))]))]
    (_, _, (_, tensors)), = FileSystemWriterAsync.preload_tensors(buckets)
    return tensors[0][1].tolist()


def _moe_router_gemm():
    # the router's linear (RouterGatingLinearFunction) reads moe_utils.te_general_gemm
    from megatron.core.transformer.moe import moe_utils

    inp = torch.arange(6.0).reshape(2, 3)
    weight = torch.arange(12.0).reshape(4, 3) / 10
    return torch.equal(moe_utils.router_gating_linear(inp, weight, None, torch.float32),
                       inp @ weight.t())


def _moe_alltoall_dispatcher():
    """Build the alltoall dispatcher (one-rank groups) and run its host-copy step: the split
    sizes must come out as the numpy arrays all_to_all_single takes, the token counts as given."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.group.WORLD
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               num_moe_experts=2, moe_token_dispatcher_type="alltoall",
                               use_cpu_initialization=True)
    dispatcher = MoEAlltoAllTokenDispatcher(
        2, [0, 1], config=config,
        pg_collection=ProcessGroupCollection(ep=world, expt_tp=world, tp_ep=world))
    splits = ("input_splits", "output_splits", "output_splits_tp")
    for name in splits:
        setattr(dispatcher, name, torch.tensor([3]))
    tokens = torch.tensor([1, 2])
    out = dispatcher._maybe_dtoh_and_synchronize(dispatcher.cuda_dtoh_point, tokens)
    return out is tokens, [type(getattr(dispatcher, n)).__name__ for n in splits]


# shim → (probe, its value with the shim, the upstream failure it fixes: error regex, or None
# when upstream silently does the wrong thing).
PROBES = {
    "cuda_to_cpu_mode": (_device_literal, "cpu", "not compiled with CUDA"),
    "current_device": (_current_device, "cpu", "not compiled with CUDA"),
    "default_causal_mask": (_causal_mask_in_backward,
                            ("cpu", [[False, True, True], [False, False, True],
                                     [False, False, False]]),
                            "not compiled with CUDA|accelerator"),
    "rng_get_state": (_rng_get_state, True, "not compiled with CUDA"),
    # Upstream queues the set for a CUDA init that never comes: silently ignored (None).
    "rng_set_state": (_rng_set_state, True, None),
    "rng_tracker_add": (_rng_tracker, (True, True), "not compiled with CUDA"),
    "fp16_optimizer_type_check": (_fp16_optimizer, True,
                                  "TypeError: Wrapped parameters must be one of "
                                  "torch.cuda.FloatTensor"),
    "distrib_optimizer_type_check": (_distrib_optimizer, True,
                                     "TypeError: Wrapped parameters must be one of "
                                     "torch.cuda.FloatTensor"),
    "clip_grad_type_check": (_clip_grad, [0.125] * 3, "AssertionError"),
    # SP norm weights are marked so finalize_model_grads all-reduces them over TP.
    "torch_norm_sequence_parallel": (_torch_norm_sp, ("RMSNorm", True, False),
                                     "sequence parallel not supported by torch LayerNorm"),
    "checkpoint_preload_sync": (_checkpoint_preload, [0.0, 1.0, 2.0], "not compiled with CUDA"),
    "moe_router_gemm": (_moe_router_gemm, True, "NameError: name 'te_general_gemm'"),
    "moe_alltoall_streams": (_moe_alltoall_dispatcher, (True, ["ndarray"] * 3),
                             "torch.cuda.Stream requires CUDA"),
}


def _attempt(probe):
    try:
        return {"ok": True, "value": probe()}
    except Exception as err:  # noqa: BLE001 — the failure is the observation
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}


def _mode_in_backward() -> str:
    """A device="cuda" allocation inside a backward pass, with every shim applied."""
    try:
        return _in_backward(lambda: torch.zeros(1, device="cuda").device.type)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__


def _probe_all(rank, world):
    """Install the shims one at a time, in the compat module's order: each probe runs once
    with every earlier shim installed but not its own, then with its own."""
    from mcore_rl.compat import apply_cpu_compat
    from mcore_rl.compat import megatron_cpu

    before, after, installed = {}, {}, []
    for name, (probe, _, _) in PROBES.items():
        before[name] = _attempt(probe)
        installed += megatron_cpu.apply(only=[name])
        after[name] = _attempt(probe)
    again = apply_cpu_compat()
    modes = sum(isinstance(m, megatron_cpu.CudaToCpuMode)
                for m in megatron_cpu._get_current_function_mode_stack())
    return {"before": before, "after": after, "installed": installed, "again": again,
            "modes": modes, "mode_in_backward": _mode_in_backward()}


@pytest.fixture(scope="module")
def observed():
    if torch.cuda.is_available():
        pytest.skip("the CPU shims are not applied when CUDA is available")
    # fresh process: the probes run before each shim is installed, and shims stay installed
    # for the life of a process (a reused rank has them from its earlier calls)
    return run_on_ranks(_probe_all, 1, timeout_s=120, init_default_group=False,
                        fresh_processes=True)[0]


@pytest.mark.parametrize("shim", SHIMS)
def test_shim_still_needed(observed, shim):
    result, (_, fixed_value, failure) = observed["before"][shim], PROBES[shim]
    if failure is None:
        assert result["ok"] and result["value"] != fixed_value, (
            f"megatron-core now gives {result!r} for {shim}'s probe on CPU without the shim: "
            "remove the shim")
    else:
        assert not result["ok"], (f"megatron-core now runs {shim}'s probe on CPU without the "
                                  f"shim (got {result.get('value')!r}): remove the shim")
        assert re.search(failure, result["error"]), result["error"]


@pytest.mark.parametrize("shim", SHIMS)
def test_shim_applied_and_correct(observed, shim):
    result = observed["after"][shim]
    assert result["ok"], f"{shim}: still fails with the shims applied: {result['error']}"
    assert result["value"] == PROBES[shim][1]


def test_every_shim_is_probed_and_apply_is_idempotent(observed):
    assert observed["installed"] == list(SHIMS) == list(PROBES)
    assert observed["again"] == []  # apply_cpu_compat() after everything: nothing new
    assert observed["modes"] == 1


def test_device_mode_is_inactive_in_backward(observed):
    # Why current_device and the causal mask are redirected rather than left to the mode: if
    # torch starts keeping function modes active in backward, this fails and they could go.
    assert observed["mode_in_backward"] != "cpu"


def test_refuses_other_megatron_versions():
    from mcore_rl.compat.megatron_cpu import MegatronVersionError, check_version

    with pytest.raises(MegatronVersionError, match="0.17.0.*written and tested for 0.16.1"):
        check_version("0.17.0")
    check_version("0.16.1")


def _cuda_rank_compat(rank, world):
    """What a CUDA rank's model build applies (`apply_cpu_compat` with its device)."""
    from mcore_rl.compat import apply_cpu_compat
    from mcore_rl.compat import megatron_cpu
    from megatron.core.transformer.moe import moe_utils

    installed = apply_cpu_compat("cuda:0")
    modes = sum(isinstance(m, megatron_cpu.CudaToCpuMode)
                for m in megatron_cpu._get_current_function_mode_stack())
    return {"installed": installed, "modes": modes,
            "router_gemm": _attempt(_moe_router_gemm),
            "te_general_gemm_defined": hasattr(moe_utils, "te_general_gemm")}


def test_a_cuda_rank_gets_the_shims_of_megatrons_gaps_without_te_only():
    """megatron-core's MoE router raised NameError (te_general_gemm) on an H200 without
    TransformerEngine: that shim is not about the device, so a CUDA rank applies it too, and
    nothing else (no device rewrite)."""
    from mcore_rl.compat import megatron_cpu
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if HAVE_TE:
        pytest.skip("TransformerEngine is installed: megatron-core defines te_general_gemm")
    got = run_on_ranks(_cuda_rank_compat, 1, timeout_s=120, init_default_group=False,
                       fresh_processes=True)[0]
    assert got["installed"] == list(megatron_cpu.WITHOUT_TE) == ["moe_router_gemm"]
    assert got["modes"] == 0 and got["te_general_gemm_defined"]
    assert got["router_gemm"] == {"ok": True, "value": PROBES["moe_router_gemm"][1]}
