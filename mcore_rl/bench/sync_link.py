"""The `link` baseline of `mcore-rl bench sync`: the plan's byte matrix moved with nothing but
the wire — what the sync group's links carry between these very ranks, measured in the same
run.

For every (sender, receiver) pair the plan connects, the same number of bytes goes as plain
non-blocking sends / receives of contiguous buffers on the same group, cut into messages of at
most one bucket (the plan's message size). No plan walking, no packing, no tensor views, no
fresh memory: the time it takes is the floor the transport is measured against
(`link_efficiency` = link time / sync time).

Buffers: a sender sends every message out of one buffer of one message; a receiver receives
into one flat buffer of everything it gets (what it would hold as shards anyway), each message
into its own region.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.resharding import Plan, SyncStats
from mcore_rl.resharding.copy_service import wait_work


def byte_matrix(plan: Plan) -> dict[tuple[int, int], int]:
    """Bytes the plan moves from each sending sync rank to each receiving one."""
    out: dict[tuple[int, int], int] = {}
    for rnd in plan.rounds:
        for t in rnd:
            pair = (t.src_rank, t.dst_rank)
            out[pair] = out.get(pair, 0) + t.numel * plan.element_size
    return out


def _chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) of each message of a pair's bytes."""
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


class LinkBaseline:
    """One rank's side of the link baseline. Buffers are allocated and touched once, before
    any timing (the floor is the wire, not first-touch page faults), and reused by every run.
    Each pair keeps `depth` messages in flight (2: measured here faster than posting every
    message at once, and than one at a time); messages to / from different peers alternate,
    so every pair streams at once. Tag = the message's index within its pair."""

    def __init__(self, plan: Plan, group: dist.ProcessGroup, sync_rank: int, *,
                 device: str | torch.device = "cpu", timeout_s: float | None = None,
                 depth: int = 2):
        self.plan, self.group, self.sync_rank = plan, group, sync_rank
        self.timeout_s, self.depth = timeout_s, depth
        self.sending = sync_rank < plan.num_src
        mine = sorted((pair, n) for pair, n in byte_matrix(plan).items() if sync_rank in pair)
        chunk, base = plan.bucket_bytes, 0
        self.per_peer = []
        for (src, dst), nbytes in mine:
            self.per_peer.append((dst if self.sending else src, base, _chunks(nbytes, chunk)))
            base += 0 if self.sending else nbytes
        size = (min(chunk, max((n for _, n in mine), default=0)) if self.sending else base)
        self.buffer = torch.ones(size, dtype=torch.uint8, device=device)  # touched

    def run(self) -> SyncStats:
        """Move this rank's row (sender) or column (receiver) of the byte matrix once."""
        stats, buf = SyncStats(), self.buffer
        stats.hold(buf.numel())
        in_flight: list[list] = [[] for _ in self.per_peer]
        depth = max((len(c) for _, _, c in self.per_peer), default=0)
        for i in range(depth):
            for p, (peer, start, chunks) in enumerate(self.per_peer):
                if i >= len(chunks):
                    continue
                if len(in_flight[p]) >= self.depth:
                    self._wait(peer, in_flight[p].pop(0))
                off, n = chunks[i]
                if self.sending:
                    work = self.group.send([buf[:n]], peer, i)
                    stats.bytes_sent += n
                else:
                    work = self.group.recv([buf[start + off:start + off + n]], peer, i)
                    stats.bytes_received += n
                in_flight[p].append(work)
                stats.messages += 1
        for p, (peer, _, _) in enumerate(self.per_peer):
            for work in in_flight[p]:
                self._wait(peer, work)
        stats.release(buf.numel())
        return stats

    def _wait(self, peer: int, work) -> None:
        wait_work(work, f"link baseline: {'send to' if self.sending else 'receive from'} "
                        f"{self.plan.label(peer)}", self.timeout_s)


__all__ = ["LinkBaseline", "byte_matrix"]
