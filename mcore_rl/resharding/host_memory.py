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
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
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


__all__ = ["empty_host"]
