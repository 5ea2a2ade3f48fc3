"""Large host buffers reused from the heap instead of mapped afresh: a CPU rank's caching.

glibc serves every allocation above its mmap threshold (32 MiB at most) with a fresh `mmap`
and returns it on free, and gives the heap's free top back to the system beyond its trim
threshold. A CPU rank allocates the same large tensors every step — the output layer's
logits and their gradient, the optimizer's temporaries of the embedding and output weights —
so each step page-faults their whole size in again, a cost of the order of the matmul that
fills them. PyTorch's CUDA allocator keeps freed blocks for reuse; its host allocations go
straight to malloc. Turning off malloc's mmap and trimming gives a CPU rank the same caching:
freed blocks return to malloc's free lists and the next step's tensors reuse them; the
process's memory stays at its peak between steps, as a GPU rank's reserved memory does.
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


__all__ = ["reuse_freed_host_memory"]
