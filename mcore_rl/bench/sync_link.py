"""The `link` baseline of `mcore-rl bench sync`: the plan's byte matrix moved with nothing but
the wire — what the sync group's links carry between these very ranks, measured in the same run.

For every (sender, receiver) pair the plan connects, the same number of bytes goes as plain
non-blocking sends / receives of contiguous buffers on the same group, cut into messages of at
most one bucket (the plan's message size), every message of a rank posted at once. No plan
walking, no packing, no tensor views: the time it takes is the floor the transport is measured
against (`link_efficiency` = link time / sync time).

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


def link_once(plan: Plan, group: dist.ProcessGroup, sync_rank: int, *,
              device: str | torch.device = "cpu",
              timeout_s: float | None = None) -> SyncStats:
    """Move this rank's row (sender) or column (receiver) of the plan's byte matrix; returns
    what was moved. Messages to / from different peers alternate, so every pair streams at
    once; tag = the message's index within its pair."""
    stats = SyncStats()
    chunk = plan.bucket_bytes
    mine = {pair: n for pair, n in byte_matrix(plan).items() if sync_rank in pair}
    sending = sync_rank < plan.num_src
    if sending:
        size = min(chunk, max(mine.values(), default=0))
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    else:
        size = sum(mine.values())
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    stats.hold(size)
    posted, base = [], 0
    per_peer = []
    for (src, dst), nbytes in sorted(mine.items()):
        peer = dst if sending else src
        per_peer.append((peer, base, _chunks(nbytes, chunk)))
        base += 0 if sending else nbytes
    depth = max((len(c) for _, _, c in per_peer), default=0)
    for i in range(depth):
        for peer, start, chunks in per_peer:
            if i >= len(chunks):
                continue
            off, n = chunks[i]
            if sending:
                posted.append((peer, group.send([buf[:n]], peer, i)))
                stats.bytes_sent += n
            else:
                posted.append((peer, group.recv([buf[start + off:start + off + n]], peer, i)))
                stats.bytes_received += n
            stats.messages += 1
    for peer, work in posted:
        wait_work(work, f"link baseline: {'send to' if sending else 'receive from'} "
                        f"{plan.label(peer)}", timeout_s)
    stats.release(size)
    return stats


__all__ = ["byte_matrix", "link_once"]
