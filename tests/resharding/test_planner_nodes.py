"""The planner keeps a transfer on the destination's node when a replica there holds it
(`build_plan(..., nodes=...)`): shapes and placement in, transfers out, no process group."""

import pytest

from mcore_rl.layouts import megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.planner import PlanError

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

MICRO = get_preset("micro")


def _pairs(plan):
    return {(t.src_rank, t.dst_rank) for rnd in plan.rounds for t in rnd}


# id: (actor grid, vLLM TP, engines, node of every sync rank: actor ranks, then engine ranks)
CASES = {
    # DP2 replicas on two nodes, one TP1 engine on each: every region from its own node
    "dp2 -> tp1 x2, 2 nodes": (ParallelConfig(dp=2), 1, 2, (0, 1, 0, 1)),
    # TP2·DP2 colocated on two nodes (2 devices each), TP2 engines: same
    "tp2 dp2 -> tp2 x2, 2 nodes": (ParallelConfig(tp=2, dp=2), 2, 2, (0, 0, 1, 1, 0, 0, 1, 1)),
}


@pytest.mark.parametrize("case", CASES)
def test_same_node_replica_is_preferred(case):
    parallel, tp, engines, nodes = CASES[case]
    src, dst = megatron_shards(MICRO, parallel), vllm_shards(MICRO, tp, engines)
    plan = build_plan(src, dst, bucket_bytes=64 << 10, nodes=nodes)
    assert all(nodes[s] == nodes[d] for s, d in _pairs(plan))
    # without placement the planner spreads over replicas and crosses nodes
    blind = build_plan(src, dst, bucket_bytes=64 << 10)
    assert any(nodes[s] != nodes[d] for s, d in _pairs(blind))
    assert plan.bytes_received() == blind.bytes_received()


def test_cross_node_only_where_no_replica_is_on_the_node():
    """PP2 over two nodes: an engine on node 0 needs stage 1's layers, held only on node 1 —
    one holder per region, so placement changes nothing and those transfers cross nodes."""
    src, dst = megatron_shards(MICRO, ParallelConfig(pp=2)), vllm_shards(MICRO, 1, 2)
    nodes = (0, 1, 0, 1)
    plan = build_plan(src, dst, bucket_bytes=64 << 10, nodes=nodes)
    assert plan.fingerprint() == build_plan(src, dst, bucket_bytes=64 << 10).fingerprint()
    assert {(s, d) for s, d in _pairs(plan) if nodes[s] != nodes[d]} == {(0, 3), (1, 2)}


def test_nodes_must_name_every_sync_rank():
    src, dst = megatron_shards(MICRO, ParallelConfig(dp=2)), vllm_shards(MICRO, 1, 2)
    with pytest.raises(PlanError, match="nodes names 3 sync ranks but the plan has 2 \\+ 2"):
        build_plan(src, dst, nodes=(0, 1, 0))


def test_a_replica_on_the_engine_ranks_own_device_is_preferred():
    """N13: colocated TP2·DP2 on one node's four GPUs, two TP2 engines on the same four: each
    engine rank takes every region from the trainer on its own GPU (a copy within the device,
    no peer mapping); told only the node, the planner spreads over the DP replicas and reads
    across GPUs. Same bytes either way."""
    src, dst = megatron_shards(MICRO, ParallelConfig(tp=2, dp=2)), vllm_shards(MICRO, 2, 2)
    nodes, devices = (0,) * 8, (0, 1, 2, 3, 0, 1, 2, 3)
    plan = build_plan(src, dst, bucket_bytes=64 << 10, nodes=nodes, devices=devices)
    assert all(devices[s] == devices[d] for s, d in _pairs(plan))
    blind = build_plan(src, dst, bucket_bytes=64 << 10, nodes=nodes)
    assert any(devices[s] != devices[d] for s, d in _pairs(blind))
    assert plan.bytes_received() == blind.bytes_received()
    # another node outweighs another device: on two nodes, the same node first
    two = (0, 0, 1, 1, 1, 1, 0, 0)  # engine 0 on node 1, engine 1 on node 0
    crossed = build_plan(src, dst, bucket_bytes=64 << 10, nodes=two, devices=(0, 1) * 4)
    assert all(two[s] == two[d] for s, d in _pairs(crossed))
    with pytest.raises(PlanError, match="devices names 3 sync ranks but the plan has 4 \\+ 4"):
        build_plan(src, dst, devices=(0, 1, 2))
