"""The streaming transport on real gloo ranks: every inference rank receives exactly its
vLLM-form shard, bit for bit, straight from the training ranks that hold the pieces.

All table rows run in ONE launch (a launch costs seconds): each row forms its own sync group
(a fresh prefix) over the first T + D processes; the others sit that row out.
"""

import os
import time

import pytest
import torch

from mcore_rl.launch.spawn import DistributedRunError, run_on_ranks
from mcore_rl.layouts import hf_shards, materialize_rank, megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import (SyncGroupSpec, build_plan, join_sync_group, receive_shards,
                                 send_shards, verify_plan)
from mcore_rl.resharding.host_memory import ReceivePool
from mcore_rl.resharding.schedule import compile_schedule

MICRO = get_preset("micro")  # 4 heads, 2 kv heads, head_dim 32, 4 layers, vocab 250
WIDE = MICRO.with_(heads=8, kv_heads=4, head_dim=16, hidden=128)
QWEN_TIED = MICRO.with_(family="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True,
                        tied_embeddings=True, vocab=251)
QWEN3 = MICRO.with_(family="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=48,
                    vocab=251)
QWEN3_MOE = QWEN3.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", head_dim=32,
                        num_experts=4, moe_ffn=64, experts_per_token=2)
MIXTRAL = MICRO.with_(family="mixtral", architecture="MixtralForCausalLM", num_experts=4,
                      moe_ffn=256, ffn=256, experts_per_token=2)
BUCKET = 64 << 10

# id: (model, training grid, vLLM TP, engines)
CASES = {
    # same TP, two engines served by every training rank
    "llama tp2pp2 -> tp2 x2": (MICRO, ParallelConfig(tp=2, pp=2), 2, 2),
    # TP up-sizing 1→2 from interleaved VPP chunks
    "llama pp2vpp2 -> tp2": (MICRO, ParallelConfig(pp=2, vpp=2), 2, 1),
    # TP down-sizing 4→2
    "wide tp4 -> tp2": (WIDE, ParallelConfig(tp=4), 2, 1),
    # TP up-sizing 2→4 with kv-head replication (4 ranks > 2 kv heads)
    "llama tp2 -> tp4 (kv replicated)": (MICRO, ParallelConfig(tp=2), 4, 1),
    # TP down-sizing 2→1, two DP replicas share the sending, two engines
    "llama tp2dp2 -> tp1 x2": (MICRO, ParallelConfig(tp=2, dp=2), 1, 2),
    # qkv bias, tied embeddings (output-layer copy on the last stage), odd vocab, uneven PP
    "qwen2 tied pp2 uneven -> tp2": (QWEN_TIED, ParallelConfig(pp=2, first_stage_layers=1), 2, 1),
    # tied embeddings at TP down-sizing 2→1 with an odd vocabulary
    "qwen2 tied tp2 -> tp1": (QWEN_TIED, ParallelConfig(tp=2), 1, 1),
    # q/k norms, head_dim 48, odd vocabulary, kv heads replicated over vLLM TP4
    "qwen3 tp2 -> tp4 (kv replicated)": (QWEN3, ParallelConfig(tp=2), 4, 1),
    # experts: EP2 (each training rank holds 2 of 4 experts) into vLLM's stacked w13/w2 at TP2
    "qwen3-moe ep2 -> tp2": (QWEN3_MOE, ParallelConfig(dp=2, ep=2), 2, 1),
    # TP2·EP2 on 2 ranks (experts whole, etp=1) down to vLLM TP1
    "mixtral tp2ep2 -> tp1": (MIXTRAL, ParallelConfig(tp=2, ep=2, etp=1), 1, 1),
    # PP2 stages of TP2·EP2, two engines at TP2
    "mixtral pp2 tp2ep2 -> tp2 x2": (MIXTRAL, ParallelConfig(tp=2, ep=2, etp=1, pp=2), 2, 2),
    # expert-TP2 (each expert's [gate; up] split like vLLM's) and EP2 over TP2·DP2 → TP2
    "qwen3-moe etp2ep2 -> tp2": (QWEN3_MOE, ParallelConfig(tp=2, dp=2, ep=2), 2, 1),
    # vLLM expert parallel (rows in VLLM_EP): each inference rank gets whole experts —
    # EP2 → EP2 (each vLLM rank fed by one training rank's experts)
    "qwen3-moe ep2 -> tp2 ep": (QWEN3_MOE, ParallelConfig(dp=2, ep=2), 2, 1),
    # expert-TP2·EP2: each whole vLLM expert is put together from two training ranks' halves
    "qwen3-moe etp2ep2 -> tp2 ep": (QWEN3_MOE, ParallelConfig(tp=2, dp=2, ep=2), 2, 1),
    # 6 experts, EP2 (3 each) → vLLM EP4 uneven (2, 2, 1, 1), across the training ranks' runs
    "mixtral tp2ep2 -> tp4 ep uneven": (MIXTRAL.with_(num_experts=6),
                                       ParallelConfig(tp=2, ep=2, etp=1), 4, 1),
}
# this row syncs twice more through a ReceivePool (new weights each time): the second
# receive must land in the first one's memory, exact, its vocabulary padding still zeros
POOLED = "qwen2 tied tp2 -> tp1"
VLLM_EP = {"qwen3-moe ep2 -> tp2 ep", "qwen3-moe etp2ep2 -> tp2 ep",
           "mixtral tp2ep2 -> tp4 ep uneven"}
MAX_RANKS = max(p.world_size + tp * e for _, p, tp, e in CASES.values())


def hf_reference(spec, seed=7):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shards(spec).hf_shapes.items()}


def run_case(rank, case_index, spec, parallel, infer_tp, engines, expert_parallel=False,
             timeout_s=30.0, pooled=False):
    """One row on this process. Returns None when this rank sits the row out."""
    src = megatron_shards(spec, parallel)
    dst = vllm_shards(spec, infer_tp, engines, expert_parallel=expert_parallel)
    plan = build_plan(src, dst, bucket_bytes=BUCKET)
    if rank >= plan.world_size:
        return None
    hf = hf_reference(spec)
    group_spec = SyncGroupSpec("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]),
                               f"case{case_index}/", plan.world_size, timeout_s=timeout_s)
    group = join_sync_group(group_spec, rank)
    verify_plan(plan, group, rank)
    if rank < plan.num_src:
        local = materialize_rank(src, rank, hf.__getitem__)
        stats = send_shards(plan, group, rank, local, dtype=torch.float32)
        for seed in (8, 9, 10) if pooled else ():
            new = hf_reference(spec, seed)
            send_shards(plan, group, rank, materialize_rank(src, rank, new.__getitem__),
                        dtype=torch.float32)
        return {"role": "src", "stats": stats.as_dict(), "shard_bytes": src.nbytes(rank, 4)}
    expected = materialize_rank(dst, rank - plan.num_src, hf.__getitem__)
    received = dict(receive_shards(plan, group, rank, dtype=torch.float32))
    mismatched = sorted(k for k in expected if k in received
                        and not torch.equal(expected[k], received[k]))
    pool_reuse = _pooled_resyncs(plan, group, rank, spec, dst) if pooled else None
    return {"role": "dst", "pool_reuse": pool_reuse,
            "missing": sorted(set(expected) - set(received)),
            "extra": sorted(set(received) - set(expected)), "mismatched": mismatched,
            "bytes": sum(t.numel() * 4 for t in received.values()),
            "planned_bytes": plan.bytes_received().get(rank, 0)}


def _pooled_resyncs(plan, group, rank, spec, dst):
    """Two syncs into one pool (weights of seeds 8, 9): is each exact, the second in the
    first's memory? Then one (seed 10) straight into given tensors (`into`, as an engine
    receives into its parameters): exact, and which shards went there?"""
    pool, ptrs, exact = ReceivePool(), [], []
    for seed in (8, 9):
        expected = materialize_rank(dst, rank - plan.num_src, hf_reference(spec, seed).__getitem__)
        received = dict(receive_shards(plan, group, rank, dtype=torch.float32, pool=pool))
        ptrs.append({k: t.data_ptr() for k, t in received.items()})
        exact.append(set(received) == set(expected) and all(
            torch.equal(expected[k], received[k]) for k in expected))
    targets = {}

    def into(key, shape, dtype, device):
        targets[key] = torch.full(shape, float("nan"), dtype=dtype)  # stale "parameters"
        return targets[key]

    expected = materialize_rank(dst, rank - plan.num_src, hf_reference(spec, 10).__getitem__)
    received = dict(receive_shards(plan, group, rank, dtype=torch.float32, pool=pool, into=into))
    exact.append(set(received) == set(expected) and all(
        torch.equal(expected[k], received[k]) for k in expected))
    covered = compile_schedule(plan, rank, sending=False).covered
    whole = {k for k, t in expected.items() if covered.get(k, 0) == t.numel()}
    return {"exact": exact, "same_memory": ptrs[0] == ptrs[1], "pooled_bytes": pool.nbytes,
            "into": sorted(k for k in received if received[k] is targets.get(k)),
            "whole": sorted(whole), "asked_for": sorted(targets), "keys": len(received)}


def run_table(rank, world_size):
    out = {}
    for i, (case_id, case) in enumerate(CASES.items()):
        try:
            out[case_id] = run_case(rank, i, *case, expert_parallel=case_id in VLLM_EP,
                                    pooled=case_id == POOLED)
        except Exception as err:  # recorded per row so one broken row doesn't hide the rest
            out[case_id] = {"role": "error", "error": f"{type(err).__name__}: {err}"}
    return out


@pytest.fixture(scope="module")
def table():
    return run_on_ranks(run_table, MAX_RANKS, timeout_s=600, init_default_group=False)


@pytest.mark.parametrize("case_id", CASES)
def test_every_inference_rank_gets_its_exact_shard(table, case_id):
    results = [r[case_id] for r in table if r[case_id] is not None]
    errors = [r["error"] for r in results if r["role"] == "error"]
    assert not errors, errors
    dst = [r for r in results if r["role"] == "dst"]
    spec, parallel, infer_tp, engines = CASES[case_id]
    assert len(dst) == infer_tp * engines
    for r in dst:
        assert not r["missing"] and not r["extra"] and not r["mismatched"], r
        if case_id == POOLED:  # reused memory: exact, padding zero, no fresh allocation
            assert r["pool_reuse"]["exact"] == [True, True, True], r["pool_reuse"]
            # every wholly covered shard, and only those, went straight where `into` said;
            # a padded one (vocabulary rows past the model's) through a zeroed buffer
            reuse = r["pool_reuse"]
            assert reuse["into"] == reuse["whole"] == reuse["asked_for"], reuse
            assert 0 < len(reuse["whole"]) < reuse["keys"]  # both kinds in this row
            assert r["pool_reuse"]["same_memory"], r["pool_reuse"]
            assert r["pool_reuse"]["pooled_bytes"] == r["bytes"]
    for r in (r for r in results if r["role"] == "src"):
        stats = r["stats"]
        # staging memory stays within two buckets (two rounds in flight); each shard goes
        # out at most once per engine, except kv heads that vLLM replicates over its ranks
        kv_copies = max(1, infer_tp // spec.kv_heads)
        assert stats["peak_extra_bytes"] <= 2 * BUCKET
        assert stats["bytes_sent"] <= engines * r["shard_bytes"] * (
            1 if kv_copies == 1 else 1.5)


def die_mid_stream(rank, world_size, mode, deadline_s):
    """2 training ranks (TP2) → 2 inference ranks (TP2); training rank 1 dies or stalls after
    its first message. Every wait's deadline: `deadline_s`."""
    src, dst = megatron_shards(MICRO, ParallelConfig(tp=2)), vllm_shards(MICRO, 2)
    plan = build_plan(src, dst, bucket_bytes=16 << 10)
    spec = SyncGroupSpec("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]), "die/",
                         plan.world_size, timeout_s=deadline_s)
    group = join_sync_group(spec, rank)
    hf = hf_reference(MICRO)
    start = time.monotonic()
    try:
        if rank < 2:
            local = materialize_rank(src, rank, hf.__getitem__)
            if rank == 1:
                local = FailingAfter(local, 3, mode)
            send_shards(plan, group, rank, local, dtype=torch.float32, timeout_s=deadline_s)
        else:
            for _ in receive_shards(plan, group, rank, dtype=torch.float32,
                                    timeout_s=deadline_s):
                pass
    finally:
        elapsed = time.monotonic() - start
    return elapsed


class FailingAfter(dict):
    """Tensor lookup that kills (or stalls) the process after `n` lookups."""

    def __init__(self, tensors, n, mode):
        super().__init__(tensors)
        self.left, self.mode = n, mode

    def __getitem__(self, key):
        self.left -= 1
        if self.left < 0:
            if self.mode == "die":
                os._exit(3)
            time.sleep(60)
        return super().__getitem__(key)


# mode, the waits' deadline: a stalled sender is seen at the deadline; a dead one at once —
# gloo's connection to it closes (the CPU twin of N16's NCCL async-error poll), so its
# deadline is set far beyond the time the check allows
@pytest.mark.parametrize("mode,deadline_s", [("die", 300.0), ("stall", 5.0)])
def test_a_dead_or_stalled_sender_is_named_within_the_deadline(mode, deadline_s):
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        # fresh processes: a rank exits or is killed stalled (a failed call would end the
        # session's reused ranks anyway: the next call starts new ones either way)
        run_on_ranks(die_mid_stream, 4, mode, deadline_s, timeout_s=90,
                     init_default_group=False, fresh_processes=True)
    elapsed = time.monotonic() - start
    text = str(info.value)
    # both inference ranks name the training rank that stopped sending
    assert text.count("receive from training rank 1 (tp1 pp0 dp0)") >= 1, text
    assert "hung" not in text or mode == "stall", text
    assert elapsed < 60, elapsed
