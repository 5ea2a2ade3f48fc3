"""FP8 inside the sync plan. Block-wise: the trainer ranks quantize the transfers that lie on
vLLM's 128×128 block grid, the engine rank the rest. Per tensor: the trainer ranks all-reduce
one amax per logical tensor and quantize every transfer. Either way what every engine rank ends
up with — FP8 weights and scales — equals, bit for bit, vLLM's own online loading
(`per_block_cast_to_fp8`; the TP-reduced amax and `QuantFP8`'s static cast) of its shard of the
same BF16 checkpoint. No rank quantizes more than the regions it sends or receives."""

import pytest
import torch

from mcore_rl.layouts import (hf_shards, materialize_rank, megatron_shards, vllm_fp8_names,
                              vllm_shards)
from mcore_rl.layouts.layout import box_slices
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.fp8 import (BLOCK, block_aligned, blocks_of, fp8_wire_bytes,
                                     ordered_units, quantize_blocks, quantize_with_scale,
                                     sender_quantized, tensor_scale, tensor_units,
                                     transfer_units, weight_amax)

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


GRIDS = pytest.mark.parametrize("spec,parallel,infer_tp,engines,expert_parallel", [
    (DENSE, ParallelConfig(tp=2), 2, 1, False),
    (DENSE, ParallelConfig(tp=2), 1, 1, False),
    (DENSE, ParallelConfig(tp=1, pp=2), 2, 2, False),
    (DENSE, ParallelConfig(tp=2, dp=2), 4, 1, False),
    (MOE, ParallelConfig(tp=1, dp=2, ep=2), 2, 1, False),
    (MOE, ParallelConfig(tp=1, dp=2, ep=2), 2, 1, True),
], ids=["dense tp2->tp2", "dense tp2->tp1", "dense pp2->tp2x2", "dense tp2dp2->tp4",
        "moe ep2->tp2", "moe ep2->tp2 ep"])


@GRIDS
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


def vllm_per_tensor_reference(engine_ranks, tp1_shape, moe_tp: bool):
    """vLLM's online per-tensor FP8 of `key` on each of one engine's ranks (`engine_ranks`:
    rank -> its BF16 tensor): each rank's amax (per expert for a stacked tensor), MAX-reduced
    over the engine's TP ranks where the weight is split (a replicated router is not; experts
    when `moe_tp`, each split over TP), the scale `_fp8_scale(amax)` and the static cast of
    `QuantFP8.forward_native`."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_scale
    from vllm.model_executor.layers.quantization.utils.quant_utils import (GroupShape,
                                                                           weight_amax)

    with set_current_vllm_config(VllmConfig()):
        cast = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    tensors = list(engine_ranks.values())
    stacked = tensors[0].dim() == 3
    amaxes = [weight_amax(t.flatten(1), dim=-1) if stacked else weight_amax(t).reshape(1)
              for t in tensors]
    split = len(tensors) > 1 and (moe_tp if stacked else tuple(tensors[0].shape) != tp1_shape)
    if split:  # amax_for_tp_weight_quant / amax_for_moe_weight_quant: MAX over the TP group
        amaxes = [torch.stack(amaxes).amax(0)] * len(tensors)
    out = {}
    for rank, t, amax in zip(engine_ranks, tensors, amaxes):
        scale = _fp8_scale(amax)
        if stacked:
            q = torch.stack([cast.forward_native(t[e], scale[e:e + 1])[0] for e in range(len(t))])
        else:
            q = cast.forward_native(t, scale)[0]
        out[rank] = (q, scale)
    return out


def per_tensor_sync(spec, parallel, infer_tp, engines, expert_parallel):
    """One sync under per-tensor FP8, in memory: each sender computes the amax of each region
    it sends into an FP8 tensor, keyed by its logical tensor; a MAX over all senders (the
    all-reduce) gives each logical tensor's scale; every sender quantizes its regions with it
    and the engine ranks only place bytes. Returns (got, want) per engine sync rank."""
    g = torch.Generator().manual_seed(11)
    hf = {n: torch.randn(s, generator=g).to(torch.bfloat16)
          for n, s in hf_shards(spec).hf_shapes.items()}
    src = megatron_shards(spec, parallel)
    dst = vllm_shards(spec, infer_tp, engines, expert_parallel=expert_parallel)
    full = vllm_shards(spec, 1).ranks[0]
    plan = build_plan(src, dst, bucket_bytes=1 << 30, element_size=2)
    fp8 = vllm_fp8_names(spec)
    units = tensor_units(dst, plan.num_src, fp8.__contains__)
    per_transfer = transfer_units(plan, units)
    sent = {r: materialize_rank(src, r, hf.__getitem__, torch.float32) for r in src.ranks}

    def region(t):
        return sent[t.src_rank][t.src_key][box_slices(t.src_box)].to(torch.bfloat16).reshape(
            [stop - start for start, stop in t.dst_box])

    # the senders' amaxes, then the all-reduce: one float per logical tensor, in one order
    order = {u: i for i, u in enumerate(ordered_units(units))}
    amax = torch.zeros(len(order), dtype=torch.bfloat16)
    for rnd, rnd_units in zip(plan.rounds, per_transfer, strict=True):
        for t, unit in zip(rnd, rnd_units, strict=True):
            if unit is not None:
                amax[order[unit]] = torch.maximum(amax[order[unit]], weight_amax(region(t)))
    got = {d: {k: torch.zeros(s, dtype=torch.float8_e4m3fn if k in fp8 else torch.bfloat16)
               for k, s in shapes.items()} for d, shapes in plan.dst_shapes.items()}
    scales = {d: {} for d in plan.dst_shapes}
    for rnd, rnd_units in zip(plan.rounds, per_transfer, strict=True):
        for t, unit in zip(rnd, rnd_units, strict=True):
            if unit is None:
                got[t.dst_rank][t.dst_key][box_slices(t.dst_box)] = region(t)
                continue
            scale = tensor_scale(amax[order[unit]]).reshape(1)
            got[t.dst_rank][t.dst_key][box_slices(t.dst_box)] = quantize_with_scale(
                region(t), scale)  # the sender's work: its own region, its tensor's scale
            scales[t.dst_rank].setdefault(t.dst_key, {})[t.dst_box[0][0]
                                                         if len(t.dst_box) == 3 else 0] = scale
    want = {}
    for engine in range(engines):
        ranks = {plan.num_src + engine * infer_tp + r:
                 materialize_rank(dst, engine * infer_tp + r, hf.__getitem__, torch.bfloat16)
                 for r in range(infer_tp)}
        for d, expected in ranks.items():
            want[d] = {k: v for k, v in expected.items() if k not in fp8}
        for key in fp8:
            holders = {d: tensors[key] for d, tensors in ranks.items() if key in tensors}
            for d, pair in vllm_per_tensor_reference(holders, full[key].shape,
                                                     moe_tp=not expert_parallel).items():
                want[d][key] = pair
    for d, tensors in got.items():
        for key, per_slot in scales.get(d, {}).items():
            tensors[key] = (tensors[key], torch.cat([per_slot[i] for i in sorted(per_slot)]))
    return got, want, plan, len(order)


@GRIDS
def test_per_tensor_fp8_every_engine_rank_installs_vllms_own(spec, parallel, infer_tp, engines,
                                                             expert_parallel):
    got, want, plan, amaxes = per_tensor_sync(spec, parallel, infer_tp, engines, expert_parallel)
    checked = 0
    for d, tensors in want.items():
        assert got[d].keys() == tensors.keys(), d
        for key, expected in tensors.items():
            if isinstance(expected, tuple):
                (q, scale), (want_q, want_scale) = got[d][key], expected
                assert same_bits(q, want_q), (d, key)
                assert torch.equal(scale, want_scale), (d, key)
                checked += 1
            else:
                assert torch.equal(got[d][key], expected), (d, key)
    assert checked
    # every FP8 transfer is the sender's: one byte per element, a scale per tensor and rank
    fp8 = vllm_fp8_names(spec).__contains__
    units = tensor_units(vllm_shards(spec, infer_tp, engines, expert_parallel=expert_parallel),
                         plan.num_src, fp8)
    wire = fp8_wire_bytes(plan, fp8, scheme="fp8_per_tensor", units=units)
    flags = sender_quantized(plan, fp8, scheme="fp8_per_tensor")
    assert all(f == fp8(t.dst_key) for rnd, fs in zip(plan.rounds, flags) for t, f in zip(rnd, fs))
    assert wire["fp8_bytes"] == sum(t.numel for rnd in plan.rounds for t in rnd if fp8(t.dst_key))
    block = fp8_wire_bytes(plan, fp8, scheme="fp8_per_block")
    assert wire["total_bytes"] <= block["total_bytes"] < wire["without_fp8_bytes"]
    # what the senders exchange for the scales: one float per logical tensor (per expert), no
    # tensor data — every weight stays split as the trainer holds it
    # (per layer: q/k/v and o; gate/up and down, or the router and each expert's two weights)
    n_logical = spec.layers * (2 + (1 + 2 * spec.routed_experts if spec.is_moe else 2))
    assert amaxes == n_logical and wire["amax_bytes"] == 4 * n_logical


def test_a_per_tensor_scale_spans_the_whole_logical_tensor():
    dst = vllm_shards(MOE, 2, 1)
    units = tensor_units(dst, 0, vllm_fp8_names(MOE).__contains__)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert units[(0, qkv, -1)] == units[(1, qkv, -1)] == frozenset(
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert units[(0, w13, 3)] == units[(1, w13, 3)] != units[(0, w13, 2)]
    assert all("experts.3." in n for n in units[(0, w13, 3)])
    ep = tensor_units(vllm_shards(MOE, 2, 1, expert_parallel=True), 0,
                      vllm_fp8_names(MOE).__contains__)
    assert ep[(1, w13, 0)] == units[(0, w13, 2)]  # rank 1's first slot: global expert 2
    with pytest.raises(ValueError, match="fp8_per_channel"):
        sender_quantized(build_plan(megatron_shards(DENSE, ParallelConfig()),
                                    vllm_shards(DENSE, 1), bucket_bytes=1 << 30,
                                    element_size=2), lambda k: True, scheme="fp8_per_channel")


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


# the syncs `_fp8_channels_syncs` runs on one group of four gloo ranks (two senders, an
# engine of TP2): name -> (model, actor grid, scheme, bucket bytes, the weights' seed). Dense
# per tensor in 64 KiB buckets (transfers split into bucket-sized rows), the others in a MiB
# (whole pieces); each MoE sync's weights are those of its in-memory twin above
# (`per_tensor_sync`, `fp8_sync`), whose expectations it reuses
EP2 = ParallelConfig(tp=1, dp=2, ep=2)
CHANNEL_SYNCS = {
    "dense per tensor": (DENSE, ParallelConfig(tp=2), "fp8_per_tensor", 64 << 10, 13),
    "dense block": (DENSE, ParallelConfig(tp=2), "fp8_per_block", 1 << 20, 13),
    "moe per tensor": (MOE, EP2, "fp8_per_tensor", 1 << 20, 11),
    "moe block": (MOE, EP2, "fp8_per_block", 1 << 20, 7),
    "moe block, engine ep": (MOE, EP2, "fp8_per_block", 1 << 20, 7),
}
INFER_TP = 2


def _channel_plan(spec, parallel, scheme, bucket_bytes, expert_parallel=False):
    from mcore_rl.resharding.fp8 import with_fp8

    src = megatron_shards(spec, parallel)
    dst = vllm_shards(spec, INFER_TP, expert_parallel=expert_parallel)
    plan = build_plan(src, dst, bucket_bytes=bucket_bytes, element_size=2)
    return src, with_fp8(plan, dst, vllm_fp8_names(spec).__contains__, scheme)


def _fp8_channels_syncs(rank, world_size):
    """FP8 syncs on real gloo ranks through `SyncChannels` (what the actor ranks and the
    engines' workers run), every `CHANNEL_SYNCS` entry on the same group: each sender holds
    its Megatron shards (per tensor, every rank joins the amax exchange); returns, per
    sync, what each sender sent and each engine rank received, as bytes."""
    import os

    from mcore_rl.resharding import SyncGroupSpec
    from mcore_rl.resharding.channels import SyncChannels

    group = SyncGroupSpec("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]), "fp8/",
                          world_size, timeout_s=60.0)
    channels = SyncChannels.join(group, rank)
    out = {}
    try:
        for name, (spec, parallel, scheme, bucket_bytes, seed) in CHANNEL_SYNCS.items():
            src, plan = _channel_plan(spec, parallel, scheme, bucket_bytes,
                                      expert_parallel=name.endswith("engine ep"))
            channels.verify(plan)
            if rank < plan.num_src:
                hf = _hf_weights(spec, seed)
                stats = channels.send(plan, materialize_rank(src, rank, hf.__getitem__),
                                      dtype=torch.bfloat16, timeout_s=60.0)
                out[name] = {"sent": stats["bytes_sent"]}
            else:
                out[name] = {"received": {
                    k: (str(t.dtype), t.clone()) for k, t in
                    channels.receive(plan, dtype=torch.bfloat16, timeout_s=60.0)}}
        return out
    finally:
        channels.close()


CHANNELS_GRID = (ParallelConfig(tp=2), INFER_TP)  # the dense syncs: TP2 -> TP2


@pytest.fixture(scope="module")
def channel_syncs():
    """Every `CHANNEL_SYNCS` sync on the four ranks of one launch: per sync, each rank's
    result (`_fp8_channels_syncs`)."""
    from mcore_rl.launch.spawn import run_on_ranks

    outs = run_on_ranks(_fp8_channels_syncs, 2 + INFER_TP, init_default_group=False,
                        timeout_s=300)
    return {name: [out[name] for out in outs] for name in CHANNEL_SYNCS}


def _hf_weights(spec, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shards(spec).hf_shapes.items()}


def test_per_tensor_fp8_through_the_sync_channels_of_several_senders(channel_syncs):
    """TP2 → TP2 on four gloo ranks: two senders each all-reduce their regions' amaxes with
    the two engine ranks and send their FP8 regions in one byte; each engine rank gets
    its FP8 weights' bytes and scales equal to vLLM's own per-tensor loading of its shard
    (the MAX over the engine's TP ranks included), everything else in BF16 as it is."""
    from mcore_rl.resharding.fp8 import scale_name

    parallel, infer_tp = CHANNELS_GRID
    outs = channel_syncs["dense per tensor"]
    hf = {k: v.to(torch.bfloat16) for k, v in _hf_weights(DENSE, seed=13).items()}
    dst, fp8 = vllm_shards(DENSE, infer_tp), vllm_fp8_names(DENSE)
    expected = {r: materialize_rank(dst, r, hf.__getitem__, torch.bfloat16)
                for r in range(infer_tp)}
    full = vllm_shards(DENSE, 1).ranks[0]
    checked = 0
    for key in fp8:
        holders = {r: tensors[key] for r, tensors in expected.items()}
        for r, (q, scale) in vllm_per_tensor_reference(holders, full[key].shape,
                                                       moe_tp=True).items():
            got = outs[parallel.world_size + r]["received"]
            dtype, held = got[key]
            assert dtype == "torch.uint8" and torch.equal(held, q.view(torch.uint8)), (r, key)
            assert torch.equal(got[scale_name(key)][1], scale)
            checked += 1
    assert checked == len(fp8) * infer_tp
    for r, tensors in expected.items():
        got = outs[parallel.world_size + r]["received"]
        for key in set(tensors) - fp8:
            assert got[key][0] == "torch.bfloat16" and torch.equal(got[key][1], tensors[key])
    # on the wire: one byte per element of every FP8 weight, two for the rest's transfers
    plan = build_plan(megatron_shards(DENSE, parallel), dst, bucket_bytes=64 << 10)
    fp8_elements = sum(t.numel() for tensors in expected.values() for k, t in tensors.items()
                       if k in fp8)
    rest_elements = sum(t.numel for rnd in plan.rounds for t in rnd if t.dst_key not in fp8)
    sent = sum(out["sent"] for out in outs[:parallel.world_size])
    assert sent == fp8_elements + 2 * rest_elements


def test_block_wise_fp8_through_the_sync_channels_of_several_senders(channel_syncs):
    """TP2 → TP2 on four gloo ranks, block-wise: a weight whose every region lies on its
    engine rank's 128×128 grid (o, down) arrives as the senders' FP8 bytes and block scales,
    equal to vLLM's own block quantization of the engine rank's shard; one with a region off
    the grid (the fused q/k/v's k and v, gate/up's seam at row 192) arrives in BF16, exactly
    the engine rank's shard, for that rank to quantize; the rest in BF16 as it is. On the
    wire: one byte per sender-quantized element plus four per block scale, two per other.
    (Buckets of a MiB: transfers are whole pieces, not split into bucket-sized rows.)"""
    from dataclasses import replace

    from mcore_rl.resharding.fp8 import (block_parts, block_scale_name, per_block_units,
                                         scale_grid)

    parallel, infer_tp = CHANNELS_GRID
    outs = channel_syncs["dense block"]
    hf = {k: v.to(torch.bfloat16) for k, v in _hf_weights(DENSE, seed=13).items()}
    dst, fp8 = vllm_shards(DENSE, infer_tp), vllm_fp8_names(DENSE)
    kinds = {}
    for r in range(infer_tp):
        expected = materialize_rank(dst, r, hf.__getitem__, torch.bfloat16)
        got = outs[parallel.world_size + r]["received"]
        assert set(got) == set(expected) | {block_scale_name(k) for k in expected
                                            if k in fp8 and got[k][0] == "torch.uint8"}
        for key, tensor in expected.items():
            dtype, held = got[key]
            if key in fp8 and dtype == "torch.uint8":  # quantized by its senders
                q, scale = vllm_reference(tensor)
                assert torch.equal(held, q.view(torch.uint8)), (r, key)
                assert torch.equal(got[block_scale_name(key)][1], scale), (r, key)
                assert scale.shape == scale_grid(tuple(tensor.shape))
            else:  # in BF16: the rest, and FP8 weights its engine rank quantizes
                assert dtype == "torch.bfloat16" and torch.equal(held, tensor), (r, key)
            kinds.setdefault(key.split(".", 3)[-1], set()).add(dtype)
    assert kinds["self_attn.o_proj.weight"] == kinds["mlp.down_proj.weight"] == {"torch.uint8"}
    assert kinds["self_attn.qkv_proj.weight"] == kinds["mlp.gate_up_proj.weight"] == {
        "torch.bfloat16"}
    plan = build_plan(megatron_shards(DENSE, parallel), dst, bucket_bytes=1 << 20,
                      element_size=2)
    plan = replace(plan, fp8=per_block_units(plan, dst, fp8.__contains__))
    rest, regions, scales = block_parts(plan)
    sent = sum(out["sent"] for out in outs[:parallel.world_size])
    wire = fp8_wire_bytes(plan, fp8.__contains__)
    assert sent == wire["total_bytes"] == (
        sum(t.numel for rnd in regions.rounds for t in rnd)
        + 4 * sum(t.numel for rnd in scales.rounds for t in rnd)
        + 2 * sum(t.numel for rnd in rest.rounds for t in rnd))
    assert wire["total_bytes"] < wire["without_fp8_bytes"]


def test_moe_fp8_through_the_sync_channels_of_several_senders(channel_syncs):
    """Qwen3-MoE, experts over EP2 on two senders → an engine of TP2: per tensor, every
    engine rank gets its FP8 expert bytes and one scale per local expert (the vector vLLM's
    fused-expert layer holds), the MAX over the engine's TP ranks included, equal to vLLM's
    own loading (`per_tensor_sync`'s reference), and the linears' as dense; block-wise, to
    the same engine and to one with expert parallelism (whole experts per rank), the tensors
    on the grid (the linears, each expert's down projection) as the senders' FP8 blocks and
    scales, those off it (each expert's gate/up seam) in BF16 for the engine rank
    (`fp8_sync`'s reference)."""
    from mcore_rl.resharding.fp8 import block_scale_name, scale_name

    fp8 = vllm_fp8_names(MOE)
    _, want, _, _ = per_tensor_sync(MOE, EP2, INFER_TP, 1, False)
    outs = channel_syncs["moe per tensor"]
    stacked = 0
    for d, tensors in want.items():
        got = outs[d]["received"]
        for key, expected in tensors.items():
            if key in fp8:
                q, scale = expected
                assert got[key][0] == "torch.uint8", (d, key)
                assert torch.equal(got[key][1], q.view(torch.uint8)), (d, key)
                assert torch.equal(got[scale_name(key)][1], scale.reshape(-1)), (d, key)
                stacked += q.dim() == 3
            else:
                assert got[key] == ("torch.bfloat16", got[key][1])
                assert torch.equal(got[key][1], expected), (d, key)
    assert stacked == 2 * MOE.layers * INFER_TP  # w13 and w2 of every layer, on each rank
    hf = {k: v.to(torch.bfloat16) for k, v in _hf_weights(MOE, 7).items()}
    for name, expert_parallel in (("moe block", False), ("moe block, engine ep", True)):
        _, want, _, _ = fp8_sync(MOE, EP2, INFER_TP, expert_parallel=expert_parallel)
        dst = vllm_shards(MOE, INFER_TP, expert_parallel=expert_parallel)
        outs, kinds = channel_syncs[name], set()
        for d, tensors in want.items():
            got, shard = outs[d]["received"], materialize_rank(dst, d - 2, hf.__getitem__,
                                                               torch.bfloat16)
            for key, expected in tensors.items():
                dtype, held = got[key]
                if key in fp8 and dtype == "torch.uint8":  # quantized by its senders
                    q, scale = expected
                    assert torch.equal(held, q.view(torch.uint8)), (name, d, key)
                    assert torch.equal(got[block_scale_name(key)][1], scale), (name, d, key)
                else:  # BF16: the rest, and FP8 tensors the engine rank quantizes
                    assert dtype == "torch.bfloat16" and torch.equal(held, shard[key]), \
                        (name, d, key)
                kinds.add((key in fp8, dtype, held.dim()))
        assert (True, "torch.uint8", 2) in kinds, name  # the linears on the grid
        # each expert's gate/up: its seam (moe_ffn 192, or a 1/2 share of 96) off the grid;
        # its down projection on it, quantized by its sender expert by expert
        assert {(True, "torch.bfloat16", 3), (True, "torch.uint8", 3)} <= kinds, name


def test_transfers_cut_to_fit_a_bucket_stay_on_the_block_grid():
    """A bucket of 300 rows of the down projection (1024 wide; 800 rows of 384-wide weights):
    the planner cuts at multiples of 128 rows (256; 768 of gate and of up), so the pieces of a
    weight that starts on the grid start on it too, and block-wise FP8 senders quantize o,
    gate/up and down whole (q/k/v's Megatron layout puts its pieces off the grid: its engine rank's)."""
    from mcore_rl.resharding.fp8 import sender_tensors

    spec = ModelSpec(family="llama", architecture="LlamaForCausalLM", hidden=384, ffn=1024,
                     heads=6, kv_heads=2, head_dim=64, layers=1, vocab=300)
    plan = build_plan(megatron_shards(spec, ParallelConfig(tp=1)), vllm_shards(spec, 1),
                      bucket_bytes=300 * 1024 * 2, element_size=2)
    for name, pieces in (("gate_up_proj", 4), ("down_proj", 2)):  # gate, up: 768 + 256 each
        cut = [t for rnd in plan.rounds for t in rnd if f".{name}." in t.dst_key]
        assert len(cut) == pieces and {t.dst_box[0][0] % 128 for t in cut} == {0}, cut
    senders = {key.split(".", 3)[3] for _, key in
               sender_tensors(plan, vllm_fp8_names(spec).__contains__)}
    assert senders == {"self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                       "mlp.down_proj.weight"}
