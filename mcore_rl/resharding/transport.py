"""Execute a resharding plan over point-to-point sends in the sync group (gloo on CPU, NCCL on
GPU), round by round.

Per round, a sending rank packs one message per destination (a slice that is already a
contiguous view of its parameter goes out as is), posts it non-blocking, and packs the next
while the first is on the wire; a receiving rank posts one receive per source — straight into
its destination tensor when the region is contiguous there — and unpacks as messages land.
Staging memory on any rank is at most one bucket (the planner bounds each rank's bytes per
round). Every wait has a deadline; a peer that dies or stalls turns into a `SyncError` that
names it, the round and the direction.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from mcore_rl.layouts.layout import box_slices
from mcore_rl.resharding.planner import Plan, Transfer


class SyncError(RuntimeError):
    """Weight sync failed; the message names the peer rank, round and direction."""


@dataclass
class SyncStats:
    """What one rank moved. peak_extra_bytes: staging buffers alive at once (the rank's own
    parameters/shards are not counted: it holds those anyway)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    peak_extra_bytes: int = 0
    messages: int = 0
    zero_copy_messages: int = 0
    seconds: float = 0.0
    _live: int = field(default=0, repr=False)

    def hold(self, nbytes: int) -> None:
        self._live += nbytes
        self.peak_extra_bytes = max(self.peak_extra_bytes, self._live)

    def release(self, nbytes: int) -> None:
        self._live -= nbytes

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def verify_plan(plan: Plan, group: dist.ProcessGroup, sync_rank: int) -> None:
    """All ranks compare plan fingerprints before any byte moves; a mismatch (ranks built from
    different configs) is named instead of corrupting weights."""
    mine = torch.frombuffer(bytearray(plan.fingerprint()), dtype=torch.uint8)
    gathered = [[torch.empty_like(mine) for _ in range(plan.world_size)]]
    _wait(group.allgather(gathered, [mine]), "fingerprint exchange", plan, None)
    differing = [r for r, fp in enumerate(gathered[0]) if not torch.equal(fp, mine)]
    if differing:
        raise SyncError(f"sync rank {sync_rank}: the resharding plan differs on "
                        f"{', '.join(plan.label(r) for r in differing)} — the ranks were "
                        "given different model/parallel/bucket settings")


def _schedule(plan: Plan, sync_rank: int, sending: bool) -> list[list[tuple[int, list[Transfer]]]]:
    """Per round: [(peer, transfers)] for this rank, in plan order."""
    out = []
    for k in range(len(plan.rounds)):
        msgs = []
        for (src, dst), transfers in plan.messages(k).items():
            if (src if sending else dst) == sync_rank:
                msgs.append((dst if sending else src, transfers))
        out.append(msgs)
    return out


def send_shards(plan: Plan, group: dist.ProcessGroup, sync_rank: int,
                tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
                timeout_s: float = 120.0) -> SyncStats:
    """Send this training rank's share of the plan from its local `tensors` (keyed as in the
    source shard map). Returns what was moved."""
    _check_dtype(plan, dtype)
    stats, start = SyncStats(), time.perf_counter()
    for k, msgs in enumerate(_schedule(plan, sync_rank, sending=True)):
        posted = []
        for dst, transfers in msgs:
            buf, staged = _pack(transfers, tensors, dtype, plan, sync_rank)
            stats.hold(staged)
            posted.append((dst, group.send([buf], dst, k), buf, staged))
            stats.messages += 1
            stats.zero_copy_messages += staged == 0
            stats.bytes_sent += buf.numel() * buf.element_size()
        for dst, work, _buf, staged in posted:
            _wait(work, f"round {k}: send to {plan.label(dst)}", plan, timeout_s)
            stats.release(staged)
    stats.seconds = time.perf_counter() - start
    return stats


def _pack(transfers: list[Transfer], tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
          plan: Plan, sync_rank: int) -> tuple[torch.Tensor, int]:
    views = []
    for t in transfers:
        if t.src_key not in tensors:
            raise SyncError(f"{plan.label(sync_rank)} has no tensor {t.src_key!r} that the "
                            "plan sends from it")
        views.append(tensors[t.src_key][box_slices(t.src_box)])
    if len(views) == 1 and views[0].is_contiguous() and views[0].dtype == dtype:
        return views[0].detach(), 0
    buf = torch.empty(sum(v.numel() for v in views), dtype=dtype)
    offset = 0
    for view in views:
        buf[offset:offset + view.numel()].view(view.shape).copy_(view)
        offset += view.numel()
    return buf, buf.numel() * buf.element_size()


def receive_shards(plan: Plan, group: dist.ProcessGroup, sync_rank: int, *,
                   dtype: torch.dtype, timeout_s: float = 120.0,
                   stats: SyncStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive this inference rank's shards; yield `(name, tensor)` as each tensor completes
    (padding rows are zeros). Raises SyncError if anything expected never arrives."""
    _check_dtype(plan, dtype)
    stats = stats if stats is not None else SyncStats()
    start = time.perf_counter()
    shapes = plan.dst_shapes.get(sync_rank, {})
    remaining: dict[str, int] = {key: 0 for key in shapes}
    for rnd in plan.rounds:
        for t in rnd:
            if t.dst_rank == sync_rank:
                remaining[t.dst_key] += t.numel
    tensors: dict[str, torch.Tensor] = {}
    yielded: set[str] = set()
    for k, msgs in enumerate(_schedule(plan, sync_rank, sending=False)):
        posted = []
        for src, transfers in msgs:
            for t in transfers:
                if t.dst_key not in tensors:
                    tensors[t.dst_key] = torch.zeros(shapes[t.dst_key], dtype=dtype)
            buf, staged = _recv_buffer(transfers, tensors, dtype)
            stats.hold(staged)
            posted.append((src, transfers, buf, staged, group.recv([buf], src, k)))
            stats.messages += 1
            stats.zero_copy_messages += staged == 0
        for src, transfers, buf, staged, work in posted:
            _wait(work, f"round {k}: receive from {plan.label(src)}", plan, timeout_s)
            stats.bytes_received += buf.numel() * buf.element_size()
            if staged:
                _unpack(buf, transfers, tensors)
            stats.release(staged)
            for t in transfers:
                remaining[t.dst_key] -= t.numel
                if remaining[t.dst_key] == 0:
                    stats.seconds = time.perf_counter() - start
                    yielded.add(t.dst_key)
                    yield t.dst_key, tensors.pop(t.dst_key)
    for key, left in remaining.items():
        if left == 0 and key not in tensors and key not in yielded:
            yield key, torch.zeros(shapes[key], dtype=dtype)  # all padding: nothing to receive
    missing = sorted(key for key, left in remaining.items() if left)
    if missing:
        raise SyncError(f"{plan.label(sync_rank)}: plan ended with {len(missing)} tensors "
                        f"incomplete: {missing[:5]}")
    stats.seconds = time.perf_counter() - start


def _recv_buffer(transfers: list[Transfer], tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    if len(transfers) == 1:
        t = transfers[0]
        view = tensors[t.dst_key][box_slices(t.dst_box)]
        if view.is_contiguous():
            return view, 0
    buf = torch.empty(sum(t.numel for t in transfers), dtype=dtype)
    return buf, buf.numel() * buf.element_size()


def _unpack(buf: torch.Tensor, transfers: list[Transfer],
            tensors: dict[str, torch.Tensor]) -> None:
    offset = 0
    for t in transfers:
        view = tensors[t.dst_key][box_slices(t.dst_box)]
        view.copy_(buf[offset:offset + t.numel].view(view.shape))
        offset += t.numel


def _check_dtype(plan: Plan, dtype: torch.dtype) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    if size != plan.element_size:
        raise SyncError(f"dtype {dtype} has {size}-byte elements but the plan was built for "
                        f"{plan.element_size}-byte elements")


def _wait(work, what: str, plan: Plan, timeout_s: float | None) -> None:
    start = time.perf_counter()
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # gloo/NCCL raise RuntimeError subclasses with terse text
        raise SyncError(f"weight sync failed at {what} after "
                        f"{time.perf_counter() - start:.1f} s: {err}") from err
