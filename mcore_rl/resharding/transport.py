"""Execute a resharding plan round by round: this module resolves every message to tensor
views and does the checking (fingerprints, completeness, names); a copy service
(`copy_service.py`) moves each round's bytes — point-to-point on the sync group (gloo on CPU,
NCCL on GPU) or through a shared staging buffer for colocated ranks (`ipc_copy.py`).

Each rank walks only its own compiled share of the plan (`schedule.py`; `SyncChannels`
caches it per plan fingerprint), and keeps up to `copy.window` rounds in flight: round k + 1
is posted before round k is waited for, so the wire never idles between rounds.
Point-to-point (`P2PCopy`): every transfer is a segment on the wire, sent straight from the
parameter and received straight into the destination tensor when the region is contiguous
there (staging otherwise: at most one bucket per round in flight, ≤ 2 buckets per rank).
Receivers assemble shards on the `device` they are given (the resolved run's), in fresh host
memory backed by huge pages on CPU (`host_memory.py`). Every wait has a deadline; a peer that
dies or stalls turns into a `SyncError` that names it, the round and the direction.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Collection, Iterator, Mapping

import torch
import torch.distributed as dist

from mcore_rl.resharding.copy_service import CopyService, P2PCopy, SyncError, wait_work
from mcore_rl.resharding.digest import DigestTally
from mcore_rl.resharding.host_memory import ReceivePool, empty_host
from mcore_rl.resharding.planner import Plan
from mcore_rl.resharding.schedule import RankSchedule, compile_schedule
from mcore_rl.resharding.stats import SyncStats


# one rank's record in the plan check: the plan's sha256, a refusal flag and its reason (utf-8)
_RECORD_BYTES = 512


def verify_plan(plan: Plan, group: dist.ProcessGroup, sync_rank: int, *,
                device: str | torch.device = "cpu", problem: str | None = None) -> None:
    """All ranks compare plan fingerprints before any byte moves; a mismatch (ranks built from
    different configs) is named instead of corrupting weights. device: where `group` carries
    tensors ("cpu" for gloo, this rank's CUDA device for NCCL).

    problem: why this rank cannot take the plan (an inference rank whose parameters do not
    match it), carried in the same exchange: every rank then fails at once naming that rank
    and its reason, instead of the others waiting in the exchange for the group's deadline."""
    fingerprint = plan.fingerprint()
    record = bytearray(_RECORD_BYTES)
    record[:len(fingerprint)] = fingerprint
    if problem is not None:
        reason = problem.encode()[:_RECORD_BYTES - len(fingerprint) - 1]
        record[len(fingerprint)] = 1
        record[len(fingerprint) + 1:len(fingerprint) + 1 + len(reason)] = reason
    mine = torch.frombuffer(record, dtype=torch.uint8).to(device)
    gathered = [[torch.empty_like(mine) for _ in range(plan.world_size)]]
    wait_work(group.allgather(gathered, [mine]), "fingerprint exchange", None)
    records = [r.cpu().numpy().tobytes() for r in gathered[0]]
    differing = [r for r, rec in enumerate(records) if rec[:len(fingerprint)] != fingerprint]
    refusing = [(r, rec[len(fingerprint) + 1:].rstrip(b"\0").decode(errors="replace"))
                for r, rec in enumerate(records) if rec[len(fingerprint)]]
    if differing:
        raise SyncError(f"sync rank {sync_rank}: the resharding plan differs on "
                        f"{', '.join(plan.label(r) for r in differing)} — the ranks were "
                        "given different model/parallel/bucket settings")
    if refusing:
        raise SyncError(f"sync rank {sync_rank}: the plan does not fit "
                        + "; ".join(f"{plan.label(r)}: {why}" for r, why in refusing))


def send_shards(plan: Plan, group: dist.ProcessGroup, sync_rank: int,
                tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
                timeout_s: float = 120.0, copy: CopyService | None = None,
                peers: Collection[int] | None = None,
                schedule: RankSchedule | None = None,
                digests: DigestTally | None = None) -> SyncStats:
    """Send this training rank's share of the plan from its local `tensors` (keyed as in the
    source shard map). Returns what was moved.

    copy: how bytes move (default: point-to-point on `group`, which must then accept the
    tensors' device: gloo for CPU, NCCL for CUDA). peers: only the messages to these
    destination sync ranks (a rank that serves some engines by IPC and others by p2p calls
    once per copy service). schedule: this rank's compiled share of the plan for these
    peers (`schedule.compile_schedule`; compiled here when not given). digests: where the
    digest of every sent piece goes (`digest.py`), computed on the tensors' device while the
    round is on the wire."""
    _check_dtype(plan, dtype)
    copy = copy if copy is not None else P2PCopy(group)
    schedule = schedule or compile_schedule(plan, sync_rank, sending=True, peers=peers)
    _check_sources(schedule, tensors, plan, sync_rank)
    stats, start = SyncStats(), time.perf_counter()
    copy.start(plan, sync_rank, sending=True, dtype=dtype, timeout_s=timeout_s, stats=stats,
               peers=peers)
    window, rounds = copy.window, schedule.rounds
    try:
        for k, msgs in enumerate(rounds):  # round k posted before round k - window + 1 waits
            views = [(dst, [tensors[key][slices] for key, slices, _ in items])
                     for dst, items in msgs]
            copy.post_send(k, views)
            if digests is not None:
                for (dst, sent), targets in zip(views, schedule.targets[k]):
                    for view, (key, box) in zip(sent, targets):
                        digests.add_region(dst, key, view, box, dtype=dtype)
            if k >= window - 1:
                copy.wait_send(k - window + 1)
        for k in range(max(0, len(rounds) - window + 1), len(rounds)):
            copy.wait_send(k)
    finally:
        copy.finish()
    stats.seconds = time.perf_counter() - start
    return stats


def _check_sources(schedule: RankSchedule, tensors: Mapping[str, torch.Tensor], plan: Plan,
                   sync_rank: int) -> None:
    for msgs in schedule.rounds:
        for _, items in msgs:
            for key, _, _ in items:
                if key not in tensors:
                    raise SyncError(f"{plan.label(sync_rank)} has no tensor {key!r} that the "
                                    "plan sends from it")


def receive_shards(plan: Plan, group: dist.ProcessGroup, sync_rank: int, *,
                   dtype: torch.dtype, timeout_s: float = 120.0,
                   stats: SyncStats | None = None, device: str | torch.device = "cpu",
                   copy: CopyService | None = None,
                   schedule: RankSchedule | None = None,
                   pool: ReceivePool | None = None,
                   into: ReceiveTarget | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive this inference rank's shards; yield `(name, tensor)` as each tensor completes
    (padding rows are zeros). Raises SyncError if anything expected never arrives.

    device: where the shards are assembled — this inference rank's device from the resolved
    run (`ResolvedRun.engine_devices`). copy: how bytes move (default: point-to-point on
    `group`). schedule: this rank's compiled share of the plan (compiled when not given).
    pool: assemble into the host memory the previous receive of this plan used
    (`host_memory.ReceivePool`; the yielded tensors are then valid until the next receive).
    into(key, shape, dtype, device): the tensor a wholly covered shard is received straight
    into (the engine's own parameter: one copy fewer), or None for a buffer.

    Rounds overlap: round k + window is posted as soon as round k has landed, before round
    k's tensors are yielded, so the wire stays busy while the caller installs them."""
    _check_dtype(plan, dtype)
    stats = stats if stats is not None else SyncStats()
    copy = copy if copy is not None else P2PCopy(group)
    schedule = schedule or compile_schedule(plan, sync_rank, sending=False)
    start = time.perf_counter()
    shapes, rounds = schedule.shapes, schedule.rounds
    remaining = {key: schedule.covered.get(key, 0) for key in shapes}
    tensors: dict[str, torch.Tensor] = {}
    yielded: set[str] = set()

    if pool is not None:
        pool.start(plan.fingerprint())
    allocate = pool.take if pool is not None else _fresh
    if into is not None:
        allocate = _into_first(into, allocate, stats)

    def post(k: int) -> None:
        _post_round(k, schedule, copy, tensors, dtype, device, allocate)

    copy.start(plan, sync_rank, sending=False, dtype=dtype, timeout_s=timeout_s, stats=stats)
    try:
        for k in range(min(copy.window, len(rounds))):
            post(k)
        for k in range(len(rounds)):
            done = _land_round(k, rounds[k], copy, remaining)
            if k + copy.window < len(rounds):
                post(k + copy.window)
            for key in done:
                stats.seconds = time.perf_counter() - start
                yielded.add(key)
                yield key, tensors.pop(key)
    finally:
        copy.finish()
    for key, left in remaining.items():
        if left == 0 and key not in tensors and key not in yielded:
            # all padding: nothing to receive
            yield key, torch.zeros(shapes[key], dtype=dtype, device=device)
    _check_complete(plan, sync_rank, remaining)
    stats.seconds = time.perf_counter() - start


def _post_round(k: int, schedule: RankSchedule, copy: CopyService,
                tensors: dict[str, torch.Tensor], dtype: torch.dtype, device,
                allocate) -> None:
    """Post round k's receives straight into the destination tensors (allocated on first use
    by `allocate`: fresh memory, or a pool's; a partly covered tensor starts as zeros,
    its padding must read as zeros)."""
    shapes, views = schedule.shapes, []
    for src, items in schedule.rounds[k]:
        for key, _, _ in items:
            if key not in tensors:
                zero = schedule.covered.get(key, 0) < math.prod(shapes[key])
                tensors[key] = allocate(key, shapes[key], dtype, device=device, zero=zero)
        views.append((src, [tensors[key][slices] for key, slices, _ in items]))
    copy.post_recv(k, views)


def _fresh(key: str, shape: tuple[int, ...], dtype: torch.dtype, *, device,
           zero: bool) -> torch.Tensor:
    return empty_host(shape, dtype, device=device, zero=zero)


# (key, shape, dtype, device) -> the tensor to receive a whole shard into, or None
ReceiveTarget = Callable[[str, tuple[int, ...], torch.dtype, Any], "torch.Tensor | None"]


def _into_first(into: ReceiveTarget, allocate, stats: SyncStats):
    """`allocate`, but a wholly covered shard (no padding to zero) goes where `into` says
    when it names a place (counted in `stats.bytes_in_place`)."""
    def take(key, shape, dtype, *, device, zero):
        target = None if zero else into(key, tuple(shape), dtype, device)
        if target is None:
            return allocate(key, shape, dtype, device=device, zero=zero)
        stats.bytes_in_place += target.numel() * target.element_size()
        return target
    return take


def _land_round(k: int, round_items, copy: CopyService, remaining: dict[str, int]) -> list[str]:
    """Wait for round k; count its elements off `remaining`; the keys now complete."""
    done = []
    for i in copy.wait_recv(k):
        for key, _, numel in round_items[i][1]:
            remaining[key] -= numel
            if remaining[key] == 0:
                done.append(key)
    return done


def _check_complete(plan: Plan, sync_rank: int, remaining: dict[str, int]) -> None:
    missing = sorted(key for key, left in remaining.items() if left)
    if missing:
        raise SyncError(f"{plan.label(sync_rank)}: plan ended with {len(missing)} tensors "
                        f"incomplete: {missing[:5]}")


def _check_dtype(plan: Plan, dtype: torch.dtype) -> None:
    size = dtype.itemsize
    if size != plan.element_size:
        raise SyncError(f"dtype {dtype} has {size}-byte elements but the plan was built for "
                        f"{plan.element_size}-byte elements")
