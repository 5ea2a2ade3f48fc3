"""Block-wise FP8 inside the sync plan: the trainer ranks quantize the transfers that lie on
vLLM's 128×128 block grid, the engine rank the rest, and what every engine rank ends up with —
FP8 weights and scales — equals, bit for bit, vLLM's own block-wise loading
(`per_block_cast_to_fp8`) of its shard of the same BF16 checkpoint. No rank quantizes more than
the regions it sends or receives."""

import pytest
import torch

from mcore_rl.layouts import (hf_shards, materialize_rank, megatron_shards, vllm_fp8_names,
                              vllm_shards)
from mcore_rl.layouts.layout import box_slices
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.fp8 import (BLOCK, block_aligned, blocks_of, fp8_wire_bytes,
                                     quantize_blocks, sender_quantized)

pytestmark = pytest.mark.fast

# q/k/v 512 + 128 + 128 rows, o 256 columns, ffn 384: TP2 shards on and off the 128 grid
DENSE = ModelSpec(family="llama", architecture="LlamaForCausalLM", hidden=256, ffn=384,
                  heads=8, kv_heads=2, head_dim=64, layers=2, vocab=300)
MOE = ModelSpec(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", hidden=256, ffn=384,
                heads=4, kv_heads=2, head_dim=64, layers=2, vocab=300, qk_norm=True,
                num_experts=4, moe_ffn=192, experts_per_token=2)


def vllm_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own block-wise quantization of an engine rank's weight (each expert of a stacked
    tensor on its own, as its online MoE method does)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    if x.dim() == 2:
        return per_block_cast_to_fp8(x, block_size=list(BLOCK), use_ue8m0=False)
    pairs = [per_block_cast_to_fp8(e, block_size=list(BLOCK), use_ue8m0=False) for e in x]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (1, 5), (4, 256, 130)])
def test_quantize_blocks_is_vllms_per_block_cast(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    x[..., :1, :1] = 0  # and a block that is almost all zeros below
    if shape[-1] > 128:
        x[..., :128, 128:] = 0
    q, scale = quantize_blocks(x)
    want_q, want_scale = vllm_reference(x)
    assert same_bits(q, want_q) and torch.equal(scale, want_scale)


def test_block_alignment_and_the_scales_a_box_covers():
    assert block_aligned(((0, 128), (128, 256)), (256, 256))
    assert block_aligned(((128, 300), (0, 200)), (300, 200))  # reaches both edges
    assert not block_aligned(((0, 192), (0, 256)), (384, 256))  # ends mid-block
    assert not block_aligned(((64, 128), (0, 256)), (128, 256))  # starts mid-block
    assert block_aligned(((3, 4), (0, 128), (0, 130)), (4, 128, 130))  # an expert's slot
    assert blocks_of(((3, 4), (128, 300), (0, 130))) == ((3, 4), (1, 3), (0, 2))


def fp8_sync(spec, parallel, infer_tp, engines=1, expert_parallel=False):
    """One sync under block-wise FP8, run in memory: each transfer a sender may quantize is
    quantized from its own region (cast to the engines' BF16 first); the others arrive as BF16
    and each engine rank quantizes its tensor's remaining blocks. Returns (per engine sync
    rank: {key: (fp8, scales) or BF16}, the expected the same from vLLM's loading, the plan,
    the per-transfer flags)."""
    g = torch.Generator().manual_seed(7)
    hf = {n: torch.randn(s, generator=g).to(torch.bfloat16)
          for n, s in hf_shards(spec).hf_shapes.items()}
    src = megatron_shards(spec, parallel)
    dst = vllm_shards(spec, infer_tp, engines, expert_parallel=expert_parallel)
    plan = build_plan(src, dst, bucket_bytes=1 << 30, element_size=2)
    fp8 = vllm_fp8_names(spec)
    flags = sender_quantized(plan, fp8.__contains__)
    sent = {r: materialize_rank(src, r, hf.__getitem__, torch.float32) for r in src.ranks}
    staging = {d: {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
               for d, shapes in plan.dst_shapes.items()}
    from_senders: dict[int, dict[str, list]] = {d: {} for d in plan.dst_shapes}
    for rnd, rnd_flags in zip(plan.rounds, flags, strict=True):
        for t, quantize in zip(rnd, rnd_flags, strict=True):
            # the region as the engine holds it (a stacked expert's slot: one more dim)
            region = sent[t.src_rank][t.src_key][box_slices(t.src_box)].to(
                torch.bfloat16).reshape([stop - start for start, stop in t.dst_box])
            if quantize:  # the sender's work: its own region only
                from_senders[t.dst_rank].setdefault(t.dst_key, []).append(
                    (t.dst_box, *quantize_blocks(region)))
            else:
                staging[t.dst_rank][t.dst_key][box_slices(t.dst_box)] = region
    got, want = {}, {}
    for d in plan.dst_shapes:
        engine_rank = d - plan.num_src
        expected = materialize_rank(dst, engine_rank, hf.__getitem__, torch.bfloat16)
        got[d], want[d] = {}, {}
        for key, tensor in staging[d].items():
            if key not in fp8:
                got[d][key], want[d][key] = tensor, expected[key]
                continue
            # the engine rank's work: its own tensor's blocks, those from senders replaced
            q, scale = quantize_blocks(tensor)
            for box, sq, sscale in from_senders[d].get(key, []):
                q[box_slices(box)] = sq
                scale[box_slices(blocks_of(box))] = sscale
            got[d][key], want[d][key] = (q, scale), vllm_reference(expected[key])
    return got, want, plan, flags


@pytest.mark.parametrize("spec,parallel,infer_tp,engines,expert_parallel", [
    (DENSE, ParallelConfig(tp=2), 2, 1, False),
    (DENSE, ParallelConfig(tp=2), 1, 1, False),
    (DENSE, ParallelConfig(tp=1, pp=2), 2, 2, False),
    (DENSE, ParallelConfig(tp=2, dp=2), 4, 1, False),
    (MOE, ParallelConfig(tp=1, dp=2, ep=2), 2, 1, False),
    (MOE, ParallelConfig(tp=1, dp=2, ep=2), 2, 1, True),
], ids=["dense tp2->tp2", "dense tp2->tp1", "dense pp2->tp2x2", "dense tp2dp2->tp4",
        "moe ep2->tp2", "moe ep2->tp2 ep"])
def test_every_engine_rank_installs_vllms_own_fp8(spec, parallel, infer_tp, engines,
                                                  expert_parallel):
    got, want, plan, flags = fp8_sync(spec, parallel, infer_tp, engines, expert_parallel)
    for d, tensors in want.items():
        assert got[d].keys() == tensors.keys()
        for key, expected in tensors.items():
            if isinstance(expected, tuple):  # FP8 weights and their block scales
                (q, scale), (want_q, want_scale) = got[d][key], expected
                assert same_bits(q, want_q), (d, key)
                assert torch.equal(scale, want_scale), (d, key)
            else:  # what vLLM keeps in BF16: embeddings, norms, the LM head
                assert torch.equal(got[d][key], expected), (d, key)
    # the senders quantize part of the plan, and that part crosses the wire in FP8
    quantized = [t for rnd, fs in zip(plan.rounds, flags) for t, f in zip(rnd, fs) if f]
    assert quantized
    wire = fp8_wire_bytes(plan, vllm_fp8_names(spec).__contains__)
    assert wire["fp8_bytes"] == sum(t.numel for t in quantized)
    assert wire["without_fp8_bytes"] == sum(t.numel for rnd in plan.rounds for t in rnd) * 2
    assert wire["total_bytes"] < wire["without_fp8_bytes"]


def test_which_vllm_tensors_fp8_quantizes():
    names = vllm_fp8_names(MOE)
    assert "model.layers.1.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in names
    assert "model.layers.0.mlp.gate.weight" in names  # vLLM's router is a ReplicatedLinear
    assert not any("norm" in n or "embed" in n or "lm_head" in n for n in names)
    dense = vllm_fp8_names(DENSE)
    assert {n.split(".", 3)[3] for n in dense} == {
        "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight"}
