"""The pure planner: applied to real tensors in one process, every plan reproduces each
destination shard bit for bit; property-tested over random shapes and grids."""

from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mcore_rl.layouts import (hf_shards, materialize_rank, megatron_shards, vllm_local_experts,
                              vllm_shards)
from mcore_rl.layouts.layout import box_numel, box_slices
from mcore_rl.models.presets import get_preset
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import PlanError, build_plan

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def apply_plan_in_memory(plan, src_tensors):
    """Execute a plan without communication; also count how often each element is written."""
    out, writes = {}, {}
    for rank, shapes in plan.dst_shapes.items():
        out[rank] = {k: torch.zeros(s) for k, s in shapes.items()}
        writes[rank] = {k: torch.zeros(s, dtype=torch.int32) for k, s in shapes.items()}
    for rnd in plan.rounds:
        for t in rnd:
            src = src_tensors[t.src_rank][t.src_key][box_slices(t.src_box)]
            out[t.dst_rank][t.dst_key][box_slices(t.dst_box)] = src
            writes[t.dst_rank][t.dst_key][box_slices(t.dst_box)] += 1
    return out, writes


def check_plan(spec, parallel, infer_tp, engines, bucket_bytes, expert_parallel=False):
    g = torch.Generator().manual_seed(1)
    hf = {n: torch.randn(s, generator=g) for n, s in hf_shards(spec).hf_shapes.items()}
    src = megatron_shards(spec, parallel)
    dst = vllm_shards(spec, infer_tp, engines, expert_parallel=expert_parallel)
    plan = build_plan(src, dst, bucket_bytes=bucket_bytes)
    src_tensors = {r: materialize_rank(src, r, hf.__getitem__) for r in src.ranks}
    got, writes = apply_plan_in_memory(plan, src_tensors)
    num_src = len(src.ranks)
    for d in dst.ranks:
        expected = materialize_rank(dst, d, hf.__getitem__)
        assert got[num_src + d].keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(got[num_src + d][key], tensor), (d, key)
            # exact cover: real elements written once, padding never
            covered = torch.zeros(tensor.shape, dtype=torch.int32)
            for piece in dst.ranks[d][key].pieces:
                covered[box_slices(piece.local_box)] = 1
            assert torch.equal(writes[num_src + d][key], covered), (d, key)
    # bytes: each destination rank receives exactly its real (unpadded) elements
    received = plan.bytes_received()
    for d in dst.ranks:
        theory = sum(box_numel(p.local_box) for t in dst.ranks[d].values() for p in t.pieces)
        assert received.get(num_src + d, 0) == theory * 4
    assert sum(plan.bytes_sent().values()) == sum(received.values())
    # bounded rounds: no rank sends or receives more than a bucket per round
    for k, rnd in enumerate(plan.rounds):
        per_src, per_dst = defaultdict(int), defaultdict(int)
        for t in rnd:
            per_src[t.src_rank] += t.numel * 4
            per_dst[t.dst_rank] += t.numel * 4
        row_floor = max(t.numel * 4 // max(1, t.src_box[0][1] - t.src_box[0][0]) for t in rnd)
        assert max(per_src.values()) <= max(bucket_bytes, row_floor)
        assert max(per_dst.values()) <= max(bucket_bytes, row_floor)
    return plan


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv=st.sampled_from([1, 2, 4]), ratio=st.sampled_from([1, 2]),
       head_dim=st.sampled_from([2, 4]), hidden=st.sampled_from([8, 12]),
       ffn=st.sampled_from([8, 16, 24]), vocab=st.integers(5, 200),
       layers=st.integers(1, 4), tied=st.booleans(), qwen=st.booleans(),
       tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]), dp=st.sampled_from([1, 2]),
       infer_tp=st.sampled_from([1, 2, 4, 8]), engines=st.integers(1, 2),
       bucket=st.sampled_from([64, 512, 1 << 20]))
def test_random_plans_cover_every_destination_element_exactly_once(
        kv, ratio, head_dim, hidden, ffn, vocab, layers, tied, qwen, tp, pp, dp, infer_tp,
        engines, bucket):
    heads = kv * ratio
    assume(kv % tp == 0 and ffn % tp == 0 and layers % pp == 0)
    assume(heads % infer_tp == 0 and (kv % infer_tp == 0 or infer_tp % kv == 0))
    spec = ModelSpec(family="qwen2" if qwen else "llama", architecture="x", hidden=hidden,
                     ffn=ffn, heads=heads, kv_heads=kv, head_dim=head_dim, layers=layers,
                     vocab=vocab, tied_embeddings=tied, qkv_bias=qwen)
    check_plan(spec, ParallelConfig(tp=tp, pp=pp, dp=dp), infer_tp, engines, bucket)


MOE = get_preset("micro-moe")  # Qwen3-MoE: 4 experts of ffn 64, 4 layers
# id: (model, training grid, vLLM TP, engines), all into vLLM with expert_parallel
EP_CASES = {
    "ep2 -> tp2 ep": (MOE, ParallelConfig(dp=2, ep=2), 2, 1),
    "tp2ep2 (experts whole) -> tp2 ep x2": (MOE, ParallelConfig(tp=2, ep=2, etp=1), 2, 2),
    "etp2ep2 (experts split) -> tp2 ep": (MOE, ParallelConfig(tp=2, dp=2, ep=2), 2, 1),
    "pp2 ep2 -> tp4 ep (1 expert each)": (MOE, ParallelConfig(pp=2, dp=2, ep=2), 4, 1),
    "6 experts ep2 -> tp4 ep (uneven 2,2,1,1)": (MOE.with_(num_experts=6),
                                                 ParallelConfig(dp=2, ep=2), 4, 1),
}


@pytest.mark.parametrize("case_id", EP_CASES)
def test_megatron_experts_into_vllm_expert_parallel(case_id):
    """Every vLLM EP rank gets exactly its own experts (vLLM's placement) and dense shards:
    bit for bit, each element once, bytes = its ideal (check_plan), no other expert's bytes."""
    spec, parallel, infer_tp, engines = EP_CASES[case_id]
    plan = check_plan(spec, parallel, infer_tp, engines, 1 << 16, expert_parallel=True)
    dst = vllm_shards(spec, infer_tp, engines, expert_parallel=True)
    for d, tensors in dst.ranks.items():
        mine = set(vllm_local_experts(spec.num_experts, infer_tp, d % infer_tp))
        held = {int(p.hf_name.split(".experts.")[1].split(".")[0])
                for t in tensors.values() for p in t.pieces if ".experts." in p.hf_name}
        assert held == mine, (d, held, mine)
        received = {t.dst_key for rnd in plan.rounds for t in rnd
                    if t.dst_rank == plan.num_src + d}
        assert received == set(tensors), d
    # whole experts: a rank's expert bytes are its experts' share of all expert parameters
    expert_bytes = 3 * spec.moe_ffn * spec.hidden * 4 * spec.layers
    for d in dst.ranks:
        experts = len(vllm_local_experts(spec.num_experts, infer_tp, d % infer_tp))
        dense = vllm_shards(spec, infer_tp, engines).ranks[d]
        dense_bytes = sum(box_numel(p.hf_box) for k, t in dense.items()
                          if "routed_experts" not in k for p in t.pieces) * 4
        assert plan.bytes_received()[plan.num_src + d] == experts * expert_bytes + dense_bytes


def test_dp_replicas_share_the_sending():
    plan = check_plan(get_preset("micro"), ParallelConfig(tp=2, dp=2), 2, 2, 1 << 20)
    sent = plan.bytes_sent()
    assert set(sent) == {0, 1, 2, 3}
    assert max(sent.values()) < 1.3 * min(sent.values())  # balanced over replicas


def test_each_training_rank_sends_its_shard_at_most_once_per_engine():
    spec = get_preset("micro")
    parallel = ParallelConfig(tp=2, pp=2)
    src = megatron_shards(spec, parallel)
    engines, infer_tp = 3, 2
    plan = build_plan(src, vllm_shards(spec, infer_tp, engines), bucket_bytes=1 << 16)
    for rank in src.ranks:
        shard_bytes = src.nbytes(rank, 4)
        per_engine = defaultdict(int)
        for rnd in plan.rounds:
            for t in rnd:
                if t.src_rank == rank:
                    per_engine[(t.dst_rank - len(src.ranks)) // infer_tp] += t.numel * 4
        assert set(per_engine) <= set(range(engines))
        assert all(b <= shard_bytes for b in per_engine.values()), (rank, per_engine)


def test_plan_is_deterministic():
    spec = get_preset("micro")
    a = build_plan(megatron_shards(spec, ParallelConfig(tp=2, pp=2)), vllm_shards(spec, 2))
    b = build_plan(megatron_shards(spec, ParallelConfig(tp=2, pp=2)), vllm_shards(spec, 2))
    assert a.fingerprint() == b.fingerprint()


def test_70b_plans_from_shapes_alone():
    spec = get_preset("llama3-70b")
    plan = build_plan(megatron_shards(spec, ParallelConfig(tp=8, pp=2)), vllm_shards(spec, 8, 2),
                      bucket_bytes=512 << 20, element_size=2)
    received = plan.bytes_received()
    # each of 16 inference ranks gets 1/8 of the sharded weights plus replicated norms
    assert len(received) == 16
    total = spec.num_params() * 2
    assert all(0.12 * total < b < 0.13 * total for b in received.values())


def test_mismatched_families_and_shapes_are_refused_before_planning():
    micro = get_preset("micro")
    qwen = micro.with_(family="qwen2", qkv_bias=True)
    with pytest.raises(PlanError, match="model families differ"):
        build_plan(megatron_shards(micro, ParallelConfig()), vllm_shards(qwen, 1))
    wider = micro.with_(hidden=256)
    with pytest.raises(PlanError, match=r"tensor model\.embed_tokens\.weight: source shape"):
        build_plan(megatron_shards(micro, ParallelConfig()), vllm_shards(wider, 1))


WIDE = get_preset("micro").with_(heads=8, kv_heads=4, head_dim=16, hidden=128)


@pytest.mark.parametrize("spec,parallel,infer_tp", [
    (get_preset("micro"), ParallelConfig(tp=2), 2),
    (get_preset("micro"), ParallelConfig(tp=2, dp=2), 2),
    (WIDE, ParallelConfig(tp=4), 2)])
def test_replicated_tensors_come_from_a_rank_already_sending_there(spec, parallel, infer_tp):
    """S1: TP-replicated norms (held by every TP rank) go to an inference rank from a training
    rank that already sends it its shards — the matching TP rank — so they add no
    sender/receiver pair; sharded regions still spread over the DP replicas."""
    src, dst = megatron_shards(spec, parallel), vllm_shards(spec, infer_tp)
    plan = build_plan(src, dst, bucket_bytes=1 << 20)
    pairs = {(t.src_rank, t.dst_rank) for msgs in plan.rounds for t in msgs}
    sharded_pairs = {(t.src_rank, t.dst_rank) for msgs in plan.rounds for t in msgs
                     if "norm" not in t.dst_key}
    assert pairs == sharded_pairs
    per_dst = {d: {s for s, dd in pairs if dd == d} for d in range(plan.num_src,
                                                                   plan.world_size)}
    if parallel.tp == infer_tp:  # rank t from TP rank t of each DP replica, and only from it
        assert all(len(srcs) == parallel.dp for srcs in per_dst.values()), per_dst
        sent = plan.bytes_sent()
        assert max(sent.values()) < 1.3 * min(sent.values())  # the replicas still share it
