"""Start-up without the cyclic garbage collector rescanning everything imported so far.

Importing torch, megatron-core and vLLM creates a few million long-lived objects (modules,
classes, functions) and next to no garbage. With the collector on, every full collection
rescans all of them, and vLLM's `LLM()` calls `gc.collect()` five times over that heap.
Measured on the 2-core CPU machine (median of 2): an engine's vLLM import plus `LLM()` took
10.2 s with the collector on and 8.1 s inside `gc_paused()` (`LLM()` alone 1.9 -> 1.0 s); an
actor rank's imports 2.8 -> 2.25 s. The engine's start-up is the longest chain of a run's
start-up, so its 2 s come off the time to the first step.

`gc_paused()` runs a block with the collector off. Leaving it, it collects once (the little
garbage the block made is freed) and freezes what survives (`gc.freeze()`: later
collections, vLLM's own included, skip those objects, which live as long as the process
anyway), then turns the collector back on. At exit the frozen objects are handed back to the
collector (`gc.unfreeze()`), so interpreter teardown still finalizes them: left frozen,
extension types that check for leaks at teardown (triton's nanobind bindings) print
"leaked instance" warnings.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from typing import Iterator

_unfreeze_at_exit = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The block with the cyclic GC off; then one collection, a freeze, the GC back on.
    Inside another `gc_paused()` (or wherever the GC is already off) it does nothing: the
    outer owner turns it back on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()
        _unfreeze_at_exit_once()


def _unfreeze_at_exit_once() -> None:
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
