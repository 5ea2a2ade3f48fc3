"""Run a function on N gloo ranks in spawned processes — used by the CLI to launch local jobs
and by every distributed test (through tests/conftest.py).

The parent owns a `TCPStore` on an OS-chosen loopback port (no free-port race; listening on
loopback only, `launch.listen`) and every child
joins the default process group through it. Each rank's return value (or its traceback) comes
back over a queue. A per-call deadline ends stragglers: their Python stacks are dumped
(faulthandler on SIGUSR1) before they are killed, and the error names the ranks that hung.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from mcore_rl.launch.listen import listening_store
from mcore_rl.parallel.world import join_default_group


class DistributedRunError(RuntimeError):
    """A rank raised, died, or missed the deadline."""


@dataclass(frozen=True)
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""


def _child_main(fn, rank, world_size, store_port, init_default_group, env, args, kwargs, results):
    os.environ.update(env)
    # torch was imported (with fn's module) before this env existed: apply the thread count
    # now, or every rank runs one thread per core and the collectives stall on a small machine
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if init_default_group:
            store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False,
                                  timeout=datetime.timedelta(seconds=60))
            join_default_group("gloo", store=store, rank=rank, world_size=world_size,
                               timeout=datetime.timedelta(seconds=120))
        value = fn(rank, world_size, *args, **kwargs)
        results.put(RankResult(rank, True, value))
    except BaseException:  # noqa: BLE001 — reported to the parent verbatim
        results.put(RankResult(rank, False, error=traceback.format_exc()))
    finally:
        if init_default_group and dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0,
                 init_default_group: bool = True, env: dict[str, str] | None = None,
                 **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` spawned gloo ranks.

    `fn` must be importable (module level). Returns the per-rank return values in rank order.
    Raises DistributedRunError naming the failing or hung ranks, with their tracebacks.
    With `init_default_group=False` the children get `MCORE_RL_STORE_PORT` and build
    whatever groups they need themselves (e.g. a trainer world plus a separate sync group).
    """
    ctx = mp.get_context("spawn")
    store = listening_store("127.0.0.1", 0, world_size + 1, timeout_s=60)
    child_env = {"OMP_NUM_THREADS": "1", "MCORE_RL_STORE_PORT": str(store.port),
                 "MASTER_ADDR": "127.0.0.1", **(env or {})}
    results = ctx.Queue()
    procs = [ctx.Process(target=_child_main, daemon=False, name=f"rank{rank}",
                         args=(fn, rank, world_size, store.port, init_default_group, child_env,
                               args, kwargs, results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        collected = _collect(procs, results, timeout_s)
    finally:
        _reap(procs)
    failures = [r for r in collected.values() if not r.ok]
    if failures:
        detail = "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in failures)
        raise DistributedRunError(f"ranks {[r.rank for r in failures]} failed:\n{detail}")
    return [collected[r].value for r in range(world_size)]


def _collect(procs, results, timeout_s) -> dict[int, RankResult]:
    deadline = time.monotonic() + timeout_s
    collected: dict[int, RankResult] = {}
    while len(collected) < len(procs):
        try:
            r = results.get(timeout=0.2)
            collected[r.rank] = r
            if not r.ok:  # one failure usually strands the peers in a collective: stop early
                deadline = min(deadline, time.monotonic() + 10.0)
            continue
        except queue.Empty:
            pass
        for rank, p in enumerate(procs):
            if rank not in collected and not p.is_alive() and p.exitcode not in (None, 0):
                collected[rank] = RankResult(rank, False,
                                             error=f"process died with exit code {p.exitcode}")
        if time.monotonic() > deadline:
            missing = [rank for rank in range(len(procs)) if rank not in collected]
            for rank in missing:
                if procs[rank].is_alive():
                    os.kill(procs[rank].pid, signal.SIGUSR1)  # stack dump to stderr
            time.sleep(1.0)
            for rank in missing:
                collected[rank] = RankResult(
                    rank, False, error=f"rank {rank} did not finish within {timeout_s:.0f} s "
                                       "(hung; its Python stack was dumped to stderr)")
    return collected


def _reap(procs) -> None:
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
