"""A link model to project a plan's time on a real cluster (no hardware needed).

Defaults describe H100 nodes: 8 GPUs a node on NVLink 4 (900 GB/s bidirectional; NCCL p2p
reaches roughly 350-400 GB/s one way) and one 400 Gb/s InfiniBand NDR NIC per GPU (50 GB/s;
~45 GB/s achieved). Every figure is an assumption printed with the projection and
overridable from the command line (`link_model.<field>=...`).

Placement: disaggregated — training ranks fill nodes first, inference ranks start on a fresh
node after them. Within a round each rank's messages are serialized on its link (a rank's
send and receive directions are independent); a round lasts as long as its busiest rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from mcore_rl.config import require_above, require_at_least
from mcore_rl.layouts import ShardMap
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import Plan
from mcore_rl.resharding.planner import Transfer


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """gpus_per_node: ranks per node. intra_node_gbs / inter_node_gbs: one-way GB/s per rank
    within a node / across nodes. latency_s: fixed cost per message."""

    gpus_per_node: int = 8
    intra_node_gbs: float = 370.0
    inter_node_gbs: float = 45.0
    latency_s: float = 20e-6

    def __post_init__(self) -> None:
        require_at_least(self, 1, "gpus_per_node")
        require_above(self, 0, "intra_node_gbs", "inter_node_gbs")
        require_at_least(self, 0, "latency_s")

    def node_of(self, sync_rank: int, num_src: int) -> int:
        if sync_rank < num_src:
            return sync_rank // self.gpus_per_node
        first_infer_node = -(-num_src // self.gpus_per_node)
        return first_infer_node + (sync_rank - num_src) // self.gpus_per_node

    def seconds(self, nbytes: int, a: int, b: int, num_src: int) -> float:
        same = self.node_of(a, num_src) == self.node_of(b, num_src)
        gbs = self.intra_node_gbs if same else self.inter_node_gbs
        return self.latency_s + nbytes / (gbs * 1e9)

    def describe(self) -> str:
        return (f"{self.gpus_per_node} ranks/node, {self.intra_node_gbs:g} GB/s intra-node, "
                f"{self.inter_node_gbs:g} GB/s inter-node per rank, "
                f"{self.latency_s * 1e6:g} us/message; training ranks fill nodes first, "
                "inference ranks on the following nodes")


def project_transport(plan: Plan, link: LinkModel,
                      transfer_bytes: Callable[[Transfer], int] | None = None) -> float:
    """Projected seconds for our transport: Σ over rounds of the busiest rank's time.
    `transfer_bytes`: a transfer's bytes on the wire (default: numel × the plan's element
    size; an FP8 sync sends its quantized transfers at one byte per element)."""
    nbytes_of = transfer_bytes or (lambda t: t.numel * plan.element_size)
    total = 0.0
    for k in range(len(plan.rounds)):
        send, recv = defaultdict(float), defaultdict(float)
        for (s, d), transfers in plan.messages(k).items():
            nbytes = sum(nbytes_of(t) for t in transfers)
            cost = link.seconds(nbytes, s, d, plan.num_src)
            send[s] += cost
            recv[d] += cost
        total += max(max(send.values(), default=0.0), max(recv.values(), default=0.0))
    return total


def project_baseline(plan: Plan, src: ShardMap, train: ParallelConfig,
                     link: LinkModel) -> float:
    """Projected seconds for gather-to-rank-0 then broadcast.

    Gather: every DP-0 shard reaches rank 0, one message per tensor, serialized on rank 0's
    ingress. Broadcast: each whole tensor is pipelined along a ring over rank 0 and the
    inference ranks, so it costs its bytes over the slowest link of the ring plus a latency
    per hop.
    """
    gather = 0.0
    holders = [r for r in src.ranks if r != 0 and train.coords_of(r)["dp"] == 0]
    for rank in holders:
        for local in src.ranks[rank].values():
            gather += link.seconds(_numel(local.shape) * plan.element_size, rank, 0, plan.num_src)
    ring = [0] + list(range(plan.num_src, plan.num_src + plan.num_dst))
    slowest = min(link.intra_node_gbs if link.node_of(a, plan.num_src) ==
                  link.node_of(b, plan.num_src) else link.inter_node_gbs
                  for a, b in zip(ring, ring[1:] + ring[:1]))
    broadcast = 0.0
    for name, shape in src.hf_shapes.items():
        broadcast += _numel(shape) * plan.element_size / (slowest * 1e9) \
            + link.latency_s * (len(ring) - 1)
    return gather + broadcast


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
