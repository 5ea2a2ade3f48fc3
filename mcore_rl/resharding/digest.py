"""Every sync verified, always: digests of the bytes a sync moved, computed on each rank's own
device, compared by all ranks of the sync group at the end of the sync.

Each training rank digests what it sends (per transfer, as the region of the destination tensor
it fills); each inference rank digests what it installed (per tensor, whole). For every
(inference rank, tensor) the pieces' digests summed over the senders must equal the installed
tensor's digest; `DigestTally.compare` checks all of them in one all-reduce on the group's gloo
control group and raises a `SyncError` that names the tensor, the inference rank that holds it
and the training ranks that sent it.

The digest of a region is two 32-bit lanes:

    lane 0 = Σ_i h(u_i)        lane 1 = Σ_i pos_i · h(u_i)        (mod 2^32)

u_i: element i's bits as an integer of its own width (int16 for bf16 / fp16, int32 for fp32;
8-byte elements as two int32 units), h: an odd multiply then a (logical) xorshift, a bijection
of 32-bit words that brings high bits down (a flipped sign bit then changes the sums like a
flipped mantissa bit; a plain sum mod 2^32 would see only the parity of sign flips; a second
odd multiply would change no comparison, the sums being linear),
pos_i: the unit's flat index in the *destination* tensor. Integer sums wrap mod 2^32, so they
are exact, equal on every device and independent of order: the pieces digested on the senders
add up to the digest of the whole tensor on its receiver, however the plan cut it. A changed
element always changes lane 0 (h is a bijection); two different elements swapped an odd
distance apart always change lane 1 (at a distance divisible by 2^k, all but about 2^(k-32)).

Cost: pos = rowbase + col, so lane 1 = Σ_rows rowbase · rowsum + Σ col · h(u): a region costs
the mix, a row sum and a column-weighted sum, in cache-sized blocks, and no per-element index
tensor; only the (tensors × 2) digests ever reach the host (one copy per sync), never a
weight.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from mcore_rl.layouts.layout import Box
from mcore_rl.resharding.copy_service import SyncError, wait_work
from mcore_rl.resharding.planner import Plan

LANES = 2
_MASK = 0xFFFFFFFF
_C1 = -1640531535  # 0x9E3779B1 as int32: odd
_LOW17 = (1 << 17) - 1  # the bits a logical right shift by 15 keeps
# units per mixing block (two int32 buffers of it, the digest's only transient memory):
# cache-sized on a CPU (1 MiB each); on a GPU 64 MiB each — few kernel launches (a GPU measured
# the larger block faster: scripts/gpu_check.sh, refit.digest_alone.by_block_units)
_BLOCK = {"cpu": 1 << 18}
_BLOCK_DEVICE = 1 << 24
_UNIT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


def region_digest(x: torch.Tensor, box: Box, shape: Sequence[int], *,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """The digest (int32 `[2]`, on x's device) of `x` as region `box` of a destination tensor
    of `shape`. x holds the region's elements in row-major order (its shape may differ from the
    box's extents by dims of extent 1); dtype: the dtype whose bits are digested (the wire's),
    x is cast to it block by block when it differs (default: x's own)."""
    dtype = dtype or x.dtype
    extents = [stop - start for start, stop in box] or [1]
    if x.numel() != math.prod(extents):
        raise ValueError(f"a region of {x.numel()} elements for box {list(box)}")
    per = max(1, dtype.itemsize // 4)  # int32 units per element
    nrows = math.prod(extents[:-1])
    rows, lane1 = _mixed_sums(x.reshape(nrows, extents[-1]), dtype, per)
    total = rows.sum(dtype=torch.int32)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    varying = [strides[d] for d, (start, stop) in enumerate(box[:-1]) if stop - start > 1]
    if len(varying) <= 1:  # rows start at first + r · step (a matrix or a vector, stacked)
        first = sum(start * strides[d] for d, (start, _) in enumerate(box)) * per
        lane1 = lane1 + total * _int32(first)
        if varying:
            r = torch.arange(nrows, dtype=torch.int32, device=x.device)
            lane1 = lane1 + (r * rows).sum(dtype=torch.int32) * _int32(varying[0] * per)
    else:
        base = _row_bases(box, tuple(shape), x.device) * per  # each row's first unit
        lane1 = lane1 + (base.to(torch.int32) * rows).sum(dtype=torch.int32)
    return torch.stack([total, lane1])


def _int32(n: int) -> int:
    """n mod 2^32 as a signed 32-bit value (an int32 tensor's multiplier)."""
    return (n + (1 << 31)) % (1 << 32) - (1 << 31)


def tensor_digest(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The digest of a whole tensor (its box is all of it)."""
    return region_digest(x, tuple((0, n) for n in x.shape), tuple(x.shape), dtype=dtype)


def _units(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The block's elements, cast to `dtype` if needed, as integers of their width (a view)."""
    if block.dtype != dtype:
        block = block.to(dtype)
    size = block.element_size()
    if size == 8 and block.stride(-1) != 1:  # two int32 units per element: a unit-stride row
        block = block.contiguous()
    return block.view(_UNIT[size])


def _mixed_sums(x2: torch.Tensor, dtype: torch.dtype, per: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """For a 2-D region `[rows, elements]`: Σ h(u) per row, and Σ col · h(u) over all of it
    (col: the unit's column in the region), int32, wrapping. Block by block (≤ `_BLOCK`
    units each), in two int32 buffers reused by every block."""
    device, (nrows, ncols) = x2.device, x2.shape
    block = _BLOCK.get(device.type, _BLOCK_DEVICE)
    cols = torch.arange(ncols * per, dtype=torch.int32, device=device)
    if nrows * ncols * per <= block:  # one block (most tensors): no buffers, no accumulation
        units = _units(x2, dtype)
        b = units * _C1 if units.dtype == torch.int32 else units.to(torch.int32).mul_(_C1)
        b.bitwise_xor_(b.bitwise_right_shift(15).bitwise_and_(_LOW17))
        return b.sum(1, dtype=torch.int32), b.mul_(cols).sum(dtype=torch.int32)
    rows = torch.zeros(nrows, dtype=torch.int32, device=device)
    by_col = torch.zeros((), dtype=torch.int32, device=device)
    col_step = max(1, min(ncols, block // per))
    row_step = max(1, block // (col_step * per))
    buf = torch.empty((min(row_step, nrows), col_step * per), dtype=torch.int32, device=device)
    tmp = torch.empty_like(buf)
    for c0 in range(0, ncols, col_step):
        for r0 in range(0, nrows, row_step):
            units = _units(x2[r0:r0 + row_step, c0:c0 + col_step], dtype)
            b, t = buf[:units.shape[0], :units.shape[1]], tmp[:units.shape[0], :units.shape[1]]
            if units.dtype == torch.int32:
                torch.mul(units, _C1, out=b)
            else:  # int16 / int8 units: sign-extended to int32 first
                b.copy_(units)
                b.mul_(_C1)
            torch.bitwise_right_shift(b, 15, out=t)
            t.bitwise_and_(_LOW17)  # a logical shift: h stays a bijection
            b.bitwise_xor_(t)
            rows[r0:r0 + b.shape[0]] += b.sum(1, dtype=torch.int32)
            by_col += b.mul_(cols[c0 * per:c0 * per + b.shape[1]]).sum(dtype=torch.int32)
    return rows, by_col


def _row_bases(box: Box, shape: tuple[int, ...], device) -> torch.Tensor:
    """The flat element index, in a contiguous tensor of `shape`, of each row's first element
    (rows: the box's leading index tuples in row-major order), int64 on `device`."""
    if not box:
        return torch.zeros(1, dtype=torch.int64, device=device)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    base = torch.full((1,), box[-1][0], dtype=torch.int64, device=device)
    for (start, stop), stride in zip(box[:-1], strides[:-1]):
        step = torch.arange(start, stop, dtype=torch.int64, device=device) * stride
        base = (base[:, None] + step[None, :]).reshape(-1)
    return base


# ---------------------------------------------------------------------------- the comparison


@dataclass
class DigestLedger:
    """One plan's digest slots: every (inference sync rank, tensor) of `plan.dst_shapes`, in
    sorted order — the layout of the vector every rank contributes to `compare`."""

    plan: Plan
    slots: dict[tuple[int, str], int] = field(init=False)

    def __post_init__(self):
        self.slots = {(d, key): i for i, (d, key) in enumerate(
            (d, key) for d in sorted(self.plan.dst_shapes)
            for key in sorted(self.plan.dst_shapes[d]))}

    def tally(self, device, *, sending: bool) -> "DigestTally":
        return DigestTally(self, torch.device(device), sending)

    def senders(self, dst: int, key: str) -> list[int]:
        """The training ranks that send a piece of `key` to inference rank `dst`."""
        return sorted({t.src_rank for rnd in self.plan.rounds for t in rnd
                       if t.dst_rank == dst and t.dst_key == key})


@dataclass
class DigestTally:
    """What one rank digested in one sync: (slot, digest) pairs on the rank's device, summed
    into the compared vector at the end (one small device → host copy). seconds: time spent
    digesting (host time: on a GPU, launching the kernels); compare_seconds: in the comparison
    (its all-reduce waits for the group's last rank)."""

    ledger: DigestLedger
    device: torch.device
    sending: bool
    seconds: float = 0.0
    compare_seconds: float = 0.0
    _slots: list[int] = field(default_factory=list)
    _digests: list[torch.Tensor] = field(default_factory=list)
    _done: set[str] = field(default_factory=set)

    def add_region(self, dst: int, key: str, x: torch.Tensor, box: Box, *,
                   dtype: torch.dtype) -> None:
        """A piece a training rank sent: `x` (its source view) as `box` of `key` on `dst`."""
        start = time.perf_counter()
        shape = self.ledger.plan.dst_shapes[dst][key]
        self._slots.append(self.ledger.slots[(dst, key)])
        self._digests.append(region_digest(x, box, shape, dtype=dtype))
        self.seconds += time.perf_counter() - start

    def add_installed(self, dst: int, key: str, x: torch.Tensor, *,
                      dtype: torch.dtype | None = None) -> None:
        """A tensor an inference rank installed (once per key; later calls are ignored)."""
        if key in self._done:
            return
        start = time.perf_counter()
        self._done.add(key)
        self._slots.append(self.ledger.slots[(dst, key)])
        self._digests.append(tensor_digest(x, dtype=dtype))
        self.seconds += time.perf_counter() - start

    def installed(self, key: str) -> bool:
        return key in self._done

    def vector(self) -> torch.Tensor:
        """`[slots, 2]` int64 on the host: the digests mod 2^32, negated on a receiver (so the
        sum over all ranks of a matching slot is 0 mod 2^32)."""
        out = torch.zeros(len(self.ledger.slots), LANES, dtype=torch.int64, device=self.device)
        if self._digests:
            index = torch.tensor(self._slots, dtype=torch.int64, device=self.device)
            values = torch.stack(self._digests).to(torch.int64) & _MASK
            out.index_add_(0, index, values if self.sending else (-values) & _MASK)
        return out.cpu()

    def compare(self, group: dist.ProcessGroup, rank: int, *,
                failed: str | None = None) -> None:
        """Every rank of the sync group calls this once per sync (receivers after installing,
        senders after sending): one all-reduce on `group` (gloo, host tensors). failed: this
        rank's own error, when it could not finish — every rank then fails at once, naming it,
        instead of waiting out a deadline. Raises SyncError naming the first mismatching tensor,
        its inference rank and the training ranks that sent it."""
        start = time.perf_counter()
        plan = self.ledger.plan
        status = torch.zeros(plan.world_size, dtype=torch.int64)
        status[rank] = failed is not None
        mine = self.vector() if failed is None else \
            torch.zeros(len(self.ledger.slots), LANES, dtype=torch.int64)
        flat = torch.cat([status, mine.reshape(-1)])
        wait_work(group.allreduce([flat]), "digest exchange", None)
        self.compare_seconds += time.perf_counter() - start
        down = [r for r in range(plan.world_size) if flat[r]]
        if down:
            raise SyncError(f"weight sync verification: {_labels(plan, down)} could not finish "
                            "the sync (its own error says why)")
        sums = flat[plan.world_size:].reshape(-1, LANES) & _MASK
        bad = sums.any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise SyncError(self._mismatch(bad))

    def _mismatch(self, bad: list[int]) -> str:
        plan, by_slot = self.ledger.plan, {i: s for s, i in self.ledger.slots.items()}
        dst, key = by_slot[bad[0]]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        return (f"weight sync verification failed: {key} as installed on {plan.label(dst)} "
                f"differs from what {_labels(plan, self.ledger.senders(dst, key))} sent"
                f"{more}")


def _labels(plan: Plan, ranks: Iterable[int]) -> str:
    return ", ".join(plan.label(r) for r in ranks) or "no training rank"


__all__ = ["DigestLedger", "DigestTally", "LANES", "region_digest", "tensor_digest"]
