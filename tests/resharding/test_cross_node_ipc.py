"""Colocated engines on two nodes (CPU twin: two "nodes" on one host): an engine receives what
its own node holds through the IPC copy service and the rest point to point, in one receive;
a training rank serves the engine of its node by IPC and the other node's by p2p, in one
send (`RoutedCopy`). IPC never maps a buffer of another node's rank."""

import os

import torch

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.layouts import materialize_rank, megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import SyncGroupSpec, SyncStats, build_plan
from mcore_rl.resharding.channels import SyncChannels

MICRO = get_preset("micro")
BUCKET = 64 << 10
# PP2 actor, one rank per node; two TP1 engines, one per node (colocated: actor rank d and
# engine d on node d). Engine 0 needs stage 1's layers, held only on node 1.
PARALLEL, TP, ENGINES, NODES = ParallelConfig(pp=2), 1, 2, (0, 1, 0, 1)


def _reference(seed):
    from mcore_rl.layouts import hf_shards

    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shards(MICRO).hf_shapes.items()}


def run_rank(rank, world_size):
    src, dst = megatron_shards(MICRO, PARALLEL), vllm_shards(MICRO, TP, ENGINES)
    plan = build_plan(src, dst, bucket_bytes=BUCKET, nodes=NODES)
    spec = SyncGroupSpec("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]), "xnode/",
                         plan.world_size, timeout_s=30.0, transports=("ipc",) * ENGINES,
                         nodes=NODES)
    channels = SyncChannels.join(spec, rank, "cpu")
    out = {"syncs": []}
    try:
        for n in range(2):  # the second sync reuses the staging and the mapped buffers
            hf = _reference(11 + n)
            channels.verify(plan)
            if rank < plan.num_src:
                local = materialize_rank(src, rank, hf.__getitem__)
                out["syncs"].append(channels.send(plan, local, dtype=torch.float32,
                                                  timeout_s=30.0))
                continue
            expected = materialize_rank(dst, rank - plan.num_src, hf.__getitem__)
            stats = SyncStats()
            got = dict(channels.receive(plan, "ipc", dtype=torch.float32, timeout_s=30.0,
                                        stats=stats))
            ipc = channels._services.get("ipc")
            out["syncs"].append({
                "mismatched": sorted(k for k in expected
                                     if k not in got or not torch.equal(expected[k], got[k])),
                "extra": sorted(set(got) - set(expected)),
                "ipc_sources": sorted(ipc._buffers) if ipc is not None else [],
                "transports": channels.transports_used(plan),
                "bytes_received": stats.bytes_received})
    finally:
        channels.close()
    return out


def test_colocated_engines_on_two_nodes_use_ipc_only_within_a_node():
    results = run_on_ranks(run_rank, 4, init_default_group=False, timeout_s=120.0)
    src, dst = megatron_shards(MICRO, PARALLEL), vllm_shards(MICRO, TP, ENGINES)
    plan = build_plan(src, dst, bucket_bytes=BUCKET, nodes=NODES)
    received = plan.bytes_received()
    for rank in (2, 3):
        for sync in results[rank]["syncs"]:
            assert not sync["mismatched"] and not sync["extra"], sync
            # IPC from its own node's training rank only; the other stage over p2p
            assert sync["ipc_sources"] == [rank - 2], sync
            assert sync["transports"] == ["ipc", "p2p"]
            assert sync["bytes_received"] == received[rank]
    for rank in (0, 1):
        sent = {(t.dst_rank, NODES[t.dst_rank] == NODES[rank]): 0 for rnd in plan.rounds
                for t in rnd if t.src_rank == rank}
        for rnd in plan.rounds:
            for t in rnd:
                if t.src_rank == rank:
                    sent[(t.dst_rank, NODES[t.dst_rank] == NODES[rank])] += t.numel * 4
        same = sum(v for (d, local), v in sent.items() if local)
        other = sum(v for (d, local), v in sent.items() if not local)
        for stats in results[rank]["syncs"]:
            assert stats["bytes_sent_ipc"] == same > 0
            assert stats["bytes_sent_p2p"] == other > 0
            assert stats["bytes_sent"] == same + other
