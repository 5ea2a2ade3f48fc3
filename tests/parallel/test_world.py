"""Leaving the default process group ends it: after `dist.destroy_process_group()` no gloo
thread is left to outlive the group into interpreter teardown (where a 2-rank srun
conversion once aborted with "terminate called without an active exception" after it had
succeeded). The trap is an import after the group exists of a module that captures it in
default arguments (torch.distributed.nn, pulled in by megatron-core, torch.distributed.checkpoint
and torch._dynamo); `join_default_group` imports those first. This module imports none of
them at the top, so each spawned rank starts without them."""

from __future__ import annotations

import datetime
import gc
import os
import sys

import torch
import torch.distributed as dist

from mcore_rl.launch.spawn import run_on_ranks

LATE_IMPORTS = ("megatron.core", "torch.distributed.checkpoint", "torch.distributed.nn")


def _gloo_threads() -> list[str]:
    names = (open(f"/proc/self/task/{tid}/comm").read().strip()
             for tid in os.listdir("/proc/self/task"))
    return sorted(name for name in names if "gloo" in name)


def _import_late_then_leave() -> dict:
    """Import the group-capturing modules with the group live, use it, leave it."""
    import importlib

    for module in LATE_IMPORTS:
        importlib.import_module(module)
    total = torch.ones(1)
    dist.all_reduce(total)
    while_joined = _gloo_threads()
    dist.destroy_process_group()
    gc.collect()
    return {"sum": total.item(), "while_joined": while_joined, "after": _gloo_threads()}


def _joined_by_the_helper(rank: int, world: int) -> dict:
    return _import_late_then_leave()        # run_on_ranks joined with join_default_group


def _joined_by_plain_init(rank: int, world: int) -> dict:
    preloaded = "torch.distributed.nn" in sys.modules
    store = dist.TCPStore("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]), world + 1,
                          is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return {**_import_late_then_leave(), "preloaded": preloaded}


def test_join_default_group_leaves_no_gloo_thread_behind():
    # fresh processes: which modules were imported before the group, and the gloo threads
    # left, are process state (a reused rank has imported them long ago)
    for out in run_on_ranks(_joined_by_the_helper, 2, timeout_s=120, fresh_processes=True):
        assert out["sum"] == 2.0
        assert out["while_joined"], "no gloo thread while joined: the check sees nothing"
        assert out["after"] == [], f"gloo threads outlived destroy_process_group: {out}"


def test_plain_init_then_a_late_import_pins_the_group():
    """The hazard `join_default_group` exists for, on this torch. If this fails, torch no
    longer captures the group at import and the pre-import in parallel/world.py can go."""
    for out in run_on_ranks(_joined_by_plain_init, 2, init_default_group=False, timeout_s=120,
                            fresh_processes=True):  # a fresh import: process state (above)
        assert not out["preloaded"], "torch.distributed.nn was imported before the group"
        assert out["sum"] == 2.0
        assert out["after"], f"the group was freed despite the late import: {out}"
