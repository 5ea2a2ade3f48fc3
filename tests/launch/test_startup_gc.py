"""`gc_paused()`: the collector is off inside; leaving, the block's garbage is collected, what
survives is frozen (later collections skip it) and the collector is back on; nested or with
the collector already off, it leaves the collector as it found it."""

from __future__ import annotations

import gc
import weakref

import pytest

from mcore_rl.launch.startup_gc import gc_paused


class _Node:
    def __init__(self):
        self.peer = self


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if was else gc.disable()


def test_off_inside_then_garbage_collected_survivors_frozen_and_back_on():
    gc.enable()
    frozen_before = gc.get_freeze_count()
    with gc_paused():
        assert not gc.isenabled()
        garbage = weakref.ref(_Node())   # a cycle: only the cyclic collector frees it
        kept = [_Node() for _ in range(100)]
        assert garbage() is not None     # nothing collected it while paused
    assert gc.isenabled()
    assert garbage() is None
    assert gc.get_freeze_count() >= frozen_before + len(kept)
    tracked = {id(obj) for obj in gc.get_objects()}
    assert not any(id(node) in tracked for node in kept), "survivors were not frozen"


def test_nested_and_already_off_leave_the_collector_as_found():
    gc.enable()
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled(), "the inner block turned the collector back on"
    assert gc.isenabled()
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_usable_as_a_decorator_and_on_after_an_error():
    gc.enable()

    @gc_paused()
    def start(fail: bool) -> bool:
        if fail:
            raise RuntimeError("start-up failed")
        return gc.isenabled()

    assert start(False) is False
    with pytest.raises(RuntimeError):
        start(True)
    assert gc.isenabled()


def test_what_was_frozen_is_finalized_at_exit():
    """Frozen objects go back to the collector at exit: interpreter teardown finalizes them
    (left frozen, triton's nanobind bindings printed "leaked instance" warnings)."""
    import subprocess
    import sys

    script = (
        "from mcore_rl.launch.startup_gc import gc_paused\n"
        "class Cycle:\n"
        "    def __init__(self): self.me = self\n"
        "    def __del__(self): print('finalized', flush=True)\n"
        "with gc_paused():\n"
        "    kept = Cycle()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "finalized" in out.stdout
