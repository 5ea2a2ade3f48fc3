"""Host buffers that are cheap to touch the first time: the weight sync's receive side writes
hundreds of MB into fresh memory on every sync.

Why: a fresh host tensor is fresh anonymous memory, and its first write faults in one 4 KiB
page at a time. Measured on the CPU machines of this project: first touch of 225 MB took
0.1–1.1 s (a refill of the same memory 0.03 s) — more than moving those bytes over loopback
gloo. Backed by transparent huge pages (2 MiB, `madvise(MADV_HUGEPAGE)`; the machines run
THP in `madvise` mode) the same first touch took 0.036 s. torch's own allocator does this only
when `THP_MEM_ALLOC_ENABLE=1` is in the environment at process start, which a library cannot
arrange for the processes it runs in (vLLM workers, Ray actors), so buffers of at least 2 MiB
are mapped here. Smaller ones, CUDA ones and hosts without MADV_HUGEPAGE take `torch.empty`.

Better still is not to need fresh memory at all: `ReceivePool` keeps one sync's received
tensors for the next sync of the same plan (measured: median link efficiency 0.61–0.74 →
0.94–1.05 of plain pre-touched sends on tiny TP2·PP2 → TP2, where first touch was the whole
gap).

The tensor keeps its mapping alive (torch.frombuffer holds a reference) and unmaps it when the
last view goes; the memory is zero-filled by the kernel.
"""

from __future__ import annotations

import mmap
import math

import torch

_HUGE = 2 << 20


def empty_host(shape: tuple[int, ...], dtype: torch.dtype, *,
               device: str | torch.device = "cpu", zero: bool = False) -> torch.Tensor:
    """A fresh, contiguous tensor; zero: its contents must be zeros (a huge-page mapping is)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=dtype, device=device)
    # private: a shared anonymous mapping is shmem, which THP leaves alone; over-sized to align
    region = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE  # huge pages need 2 MiB-aligned ranges
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start - start % mmap.PAGESIZE,
                       nbytes + start % mmap.PAGESIZE)
    except OSError:  # THP off ("never"): plain pages, still correct
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)


class ReceivePool:
    """Host memory a receiving rank reuses from one sync to the next: the tensors one receive
    assembled are handed back to the next receive of the same plan (same keys, shapes and
    padding), so only the first sync of a plan touches fresh memory.

    The contract this asks of the caller: what a receive yields is read-only and valid until
    the next receive on the same pool — anything kept longer is copied (the vLLM installer
    copies every tensor into the engine's own parameters). A pool follows one plan: a new
    fingerprint drops what the old plan left. Only host tensors are pooled; device memory
    comes from torch's caching allocator, which already reuses without first-touch cost, and
    a persistent copy of a rank's weights on a GPU would cost what it cannot spare."""

    def __init__(self) -> None:
        self._fingerprint: bytes | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    def start(self, fingerprint: bytes) -> None:
        """Begin a receive of the plan with this fingerprint."""
        if fingerprint != self._fingerprint:
            self._fingerprint, self._tensors = fingerprint, {}

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *,
             device: str | torch.device = "cpu", zero: bool = False) -> torch.Tensor:
        """The tensor for `key`: last receive's when it fits, else a fresh one (kept). Reused
        padding is still zeros: one plan writes the same regions every time."""
        old = self._tensors.get(key)
        if (old is not None and tuple(old.shape) == tuple(shape) and old.dtype == dtype
                and old.device == torch.device(device)):
            return old
        fresh = empty_host(shape, dtype, device=device, zero=zero)
        if fresh.device.type == "cpu":
            self._tensors[key] = fresh
        return fresh

    def clear(self) -> None:
        self._fingerprint, self._tensors = None, {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


__all__ = ["ReceivePool", "empty_host"]
