"""Large host buffers reused from the heap instead of mapped afresh: a CPU rank's caching.

glibc serves every allocation above its mmap threshold (32 MiB at most) with a fresh `mmap`
and returns it on free, and gives the heap's free top back to the system beyond its trim
threshold. A CPU rank allocates the same large tensors every step — the output layer's
logits and their gradient, the optimizer's temporaries of the embedding and output weights —
so each step page-faults their whole size in again, a cost of the order of the matmul that
fills them. PyTorch's CUDA allocator keeps freed blocks for reuse; its host allocations go
straight to malloc. Turning off malloc's mmap and trimming gives a CPU rank the same caching:
freed blocks return to malloc's free lists and the next step's tensors reuse them; the
process's memory stays at its peak between steps, as a GPU rank's reserved memory does. (torch
asks for aligned blocks, whose padding a freed block of the same size does not always cover:
the first few steps may take new blocks until the freed ones coalesce.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt takes an int: freed heap top is kept unless it exceeds 2 GiB
KEEP_HEAP_TOP_BYTES = 2**31 - 1
# the largest mmap threshold glibc sets itself (64-bit: DEFAULT_MMAP_THRESHOLD_MAX): a tensor
# below it is reused from the heap already once one of its size was freed
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20


def pays_off(largest_step_bytes: float) -> bool:
    """Whether a rank whose largest per-step tensor (a micro batch's fp32 logits) has this
    many bytes gains from `reuse_freed_host_memory`: only above glibc's own mmap threshold —
    below it glibc reuses the blocks already, and a heap that never shrinks only costs (small
    models, short runs: the test suite's ranks)."""
    return largest_step_bytes > GLIBC_MMAP_THRESHOLD_MAX


@functools.cache
def _glibc():
    """glibc, or None where the C library is another (musl, macOS): nothing to tune there."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def reuse_freed_host_memory() -> bool:
    """Serve this process's large allocations from malloc's heap and keep freed blocks for
    reuse (module doc); call before the rank allocates its model. True where applied (glibc
    accepted both settings), False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_HEAP_TOP_BYTES)
    )


__all__ = ["GLIBC_MMAP_THRESHOLD_MAX", "pays_off", "reuse_freed_host_memory"]
