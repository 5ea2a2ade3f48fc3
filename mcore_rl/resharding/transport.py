"""Execute a resharding plan round by round: this module resolves every message to tensor
views and does the checking (fingerprints, completeness, names); a copy service
(`copy_service.py`) moves each round's bytes — point-to-point on the sync group (gloo on CPU,
NCCL on GPU) or through a shared staging buffer for colocated ranks (`ipc_copy.py`).

Point-to-point: per round, a sending rank packs one message per destination (a slice that is
already a contiguous view of its parameter, on the wire's device, goes out as is), posts it
non-blocking, and packs the next while the first is on the wire; a receiving rank posts one
receive per source — straight into its destination tensor when the region is contiguous
there — and unpacks as messages land. Staging buffers live on the device of the tensors they
carry; receivers assemble shards on the `device` they are given (the resolved run's).
Staging memory on any rank is at most one bucket (the planner bounds each rank's bytes per
round). Every wait has a deadline; a peer that dies or stalls turns into a `SyncError` that
names it, the round and the direction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection, Iterator, Mapping

import torch
import torch.distributed as dist

from mcore_rl.layouts.layout import box_slices
from mcore_rl.resharding.copy_service import CopyService, P2PCopy, SyncError, wait_work
from mcore_rl.resharding.planner import Plan, Transfer


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


def verify_plan(plan: Plan, group: dist.ProcessGroup, sync_rank: int, *,
                device: str | torch.device = "cpu") -> None:
    """All ranks compare plan fingerprints before any byte moves; a mismatch (ranks built from
    different configs) is named instead of corrupting weights. device: where `group` carries
    tensors ("cpu" for gloo, this rank's CUDA device for NCCL)."""
    mine = torch.frombuffer(bytearray(plan.fingerprint()), dtype=torch.uint8).to(device)
    gathered = [[torch.empty_like(mine) for _ in range(plan.world_size)]]
    wait_work(group.allgather(gathered, [mine]), "fingerprint exchange", None)
    differing = [r for r, fp in enumerate(gathered[0]) if not torch.equal(fp, mine)]
    if differing:
        raise SyncError(f"sync rank {sync_rank}: the resharding plan differs on "
                        f"{', '.join(plan.label(r) for r in differing)} — the ranks were "
                        "given different model/parallel/bucket settings")


def _schedule(plan: Plan, sync_rank: int, sending: bool,
              peers: Collection[int] | None = None) -> list[list[tuple[int, list[Transfer]]]]:
    """Per round: [(peer, transfers)] for this rank, in plan order (only `peers`, if given)."""
    out = []
    for k in range(len(plan.rounds)):
        msgs = []
        for (src, dst), transfers in plan.messages(k).items():
            if (src if sending else dst) == sync_rank and \
                    (peers is None or (dst if sending else src) in peers):
                msgs.append((dst if sending else src, transfers))
        out.append(msgs)
    return out


def send_shards(plan: Plan, group: dist.ProcessGroup, sync_rank: int,
                tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
                timeout_s: float = 120.0, copy: CopyService | None = None,
                peers: Collection[int] | None = None) -> SyncStats:
    """Send this training rank's share of the plan from its local `tensors` (keyed as in the
    source shard map). Returns what was moved.

    copy: how bytes move (default: point-to-point on `group`, which must then accept the
    tensors' device: gloo for CPU, NCCL for CUDA). peers: only the messages to these
    destination sync ranks (a rank that serves some engines by IPC and others by p2p calls
    once per copy service)."""
    _check_dtype(plan, dtype)
    copy = copy if copy is not None else P2PCopy(group)
    stats, start = SyncStats(), time.perf_counter()
    copy.start(plan, sync_rank, sending=True, dtype=dtype, timeout_s=timeout_s, stats=stats,
               peers=peers)
    try:
        for k, msgs in enumerate(_schedule(plan, sync_rank, sending=True, peers=peers)):
            copy.send_round(k, [(dst, _source_views(transfers, tensors, plan, sync_rank))
                                for dst, transfers in msgs])
    finally:
        copy.finish()
    stats.seconds = time.perf_counter() - start
    return stats


def _source_views(transfers: list[Transfer], tensors: Mapping[str, torch.Tensor], plan: Plan,
                  sync_rank: int) -> list[torch.Tensor]:
    views = []
    for t in transfers:
        if t.src_key not in tensors:
            raise SyncError(f"{plan.label(sync_rank)} has no tensor {t.src_key!r} that the "
                            "plan sends from it")
        views.append(tensors[t.src_key][box_slices(t.src_box)])
    return views


def receive_shards(plan: Plan, group: dist.ProcessGroup, sync_rank: int, *,
                   dtype: torch.dtype, timeout_s: float = 120.0,
                   stats: SyncStats | None = None, device: str | torch.device = "cpu",
                   copy: CopyService | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive this inference rank's shards; yield `(name, tensor)` as each tensor completes
    (padding rows are zeros). Raises SyncError if anything expected never arrives.

    device: where the shards are assembled — this inference rank's device from the resolved
    run (`ResolvedRun.engine_devices`). copy: how bytes move (default: point-to-point on
    `group`)."""
    _check_dtype(plan, dtype)
    stats = stats if stats is not None else SyncStats()
    copy = copy if copy is not None else P2PCopy(group)
    start = time.perf_counter()
    shapes = plan.dst_shapes.get(sync_rank, {})
    remaining: dict[str, int] = {key: 0 for key in shapes}
    for rnd in plan.rounds:
        for t in rnd:
            if t.dst_rank == sync_rank:
                remaining[t.dst_key] += t.numel
    tensors: dict[str, torch.Tensor] = {}
    yielded: set[str] = set()
    copy.start(plan, sync_rank, sending=False, dtype=dtype, timeout_s=timeout_s, stats=stats)
    try:
        for k, msgs in enumerate(_schedule(plan, sync_rank, sending=False)):
            for _src, transfers in msgs:
                for t in transfers:
                    if t.dst_key not in tensors:
                        tensors[t.dst_key] = torch.zeros(shapes[t.dst_key], dtype=dtype,
                                                         device=device)
            views = [(src, [tensors[t.dst_key][box_slices(t.dst_box)] for t in transfers])
                     for src, transfers in msgs]
            for i in copy.recv_round(k, views):
                for t in msgs[i][1]:
                    remaining[t.dst_key] -= t.numel
                    if remaining[t.dst_key] == 0:
                        stats.seconds = time.perf_counter() - start
                        yielded.add(t.dst_key)
                        yield t.dst_key, tensors.pop(t.dst_key)
    finally:
        copy.finish()
    for key, left in remaining.items():
        if left == 0 and key not in tensors and key not in yielded:
            # all padding: nothing to receive
            yield key, torch.zeros(shapes[key], dtype=dtype, device=device)
    missing = sorted(key for key, left in remaining.items() if left)
    if missing:
        raise SyncError(f"{plan.label(sync_rank)}: plan ended with {len(missing)} tensors "
                        f"incomplete: {missing[:5]}")
    stats.seconds = time.perf_counter() - start


def _check_dtype(plan: Plan, dtype: torch.dtype) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    if size != plan.element_size:
        raise SyncError(f"dtype {dtype} has {size}-byte elements but the plan was built for "
                        f"{plan.element_size}-byte elements")
