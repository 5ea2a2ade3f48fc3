"""Run a function on N gloo ranks in spawned processes — used by the CLI to launch local jobs
and by every distributed test (through tests/conftest.py).

The parent owns a `TCPStore` on an OS-chosen loopback port (no free-port race; listening on
loopback only, `launch.listen`) and every child
joins the default process group through it. Each rank's return value (or its traceback) comes
back over a queue. A per-call deadline ends stragglers: their Python stacks are dumped
(faulthandler on SIGUSR1) before they are killed, and the error names the ranks that hung.

`RankPool` keeps the spawned processes for call after call: a rank's start (the process,
`import torch`, megatron-core's import on first use: ~4.4 CPU-s per rank) is paid once instead
of per call. Each call still gets its own store and default group, and every process is put
back as a fresh spawn would be before the next call (`RankPool`). Inside `pooled_ranks()` (the
test session, tests/conftest.py) `run_on_ranks` runs on such pools; elsewhere (the CLI) it
spawns afresh, and a caller that tests process-level behaviour asks for `fresh_processes`.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import itertools
import logging
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import pickle
import queue
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from mcore_rl.compat import megatron_state
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


def _child_env(store_port: int | None, env: dict[str, str] | None) -> dict[str, str]:
    """What a spawned rank's environment adds to the parent's (a pooled rank's before its
    first call has no store yet)."""
    port = {} if store_port is None else {"MCORE_RL_STORE_PORT": str(store_port)}
    return {"OMP_NUM_THREADS": "1", **port, "MASTER_ADDR": "127.0.0.1", **(env or {})}


def _call_rank(load: Callable[[], tuple], rank: int, world_size: int, store_port: int,
               init_default_group: bool) -> RankResult:
    """Join the default group (if asked) and run the rank function `load()` gives; the
    caller reports the result, then leaves the group."""
    try:
        fn, args, kwargs = load()
        if init_default_group:
            store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False,
                                  timeout=datetime.timedelta(seconds=60))
            join_default_group("gloo", store=store, rank=rank, world_size=world_size,
                               timeout=datetime.timedelta(seconds=120))
        return RankResult(rank, True, fn(rank, world_size, *args, **kwargs))
    except BaseException:  # noqa: BLE001 — reported to the parent verbatim
        return RankResult(rank, False, error=traceback.format_exc())


def _child_main(fn, rank, world_size, store_port, init_default_group, env, args, kwargs, results):
    os.environ.update(env)
    # torch was imported (with fn's module) before this env existed: apply the thread count
    # now, or every rank runs one thread per core and the collectives stall on a small machine
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        results.put(_call_rank(lambda: (fn, args, kwargs), rank, world_size, store_port,
                               init_default_group))
    finally:
        if init_default_group and dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- reused ranks

# Environment variables that differ from call to call without meaning anything to a rank
# (pytest names the running test in it): a pool's processes need not restart for them.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})
# A pooled rank's messages: its call's result, then (once it left that call's world) its reset.
_RESULT, _RESET = "result", "reset"
# Signals whose Python handlers a call may set (run.signals, launch.ray_cluster): put back.
_SIGNALS_KEPT = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2, signal.SIGALRM,
                 signal.SIGCHLD, signal.SIGPIPE)


@dataclass
class _FreshState:
    """What a call may change in a reused rank, as the process had it before its first call.
    `restore()` puts it back; `left()` names what cannot be put back (the rank retires)."""

    environ: dict[str, str]
    cwd: str
    torch_rng: Any
    numpy_rng: Any
    python_rng: Any
    torch_settings: tuple
    signals: dict
    warning_filters: list
    root_logger: tuple
    threads: set[int] = field(default_factory=set)

    @classmethod
    def capture(cls) -> _FreshState:
        root = logging.getLogger()
        return cls(environ=dict(os.environ), cwd=os.getcwd(), torch_rng=torch.get_rng_state(),
                   numpy_rng=np.random.get_state(), python_rng=random.getstate(),
                   torch_settings=_torch_settings(), signals={
                       s: signal.getsignal(s) for s in _SIGNALS_KEPT},
                   warning_filters=list(warnings.filters),
                   root_logger=(root.level, list(root.handlers)),
                   threads={t.ident for t in threading.enumerate()})

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_rng_state(self.torch_rng)
        np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)
        if _torch_settings() != self.torch_settings:  # (the first setting imports seconds)
            dtype, deterministic, warn_only, grad = self.torch_settings
            torch.set_default_dtype(dtype)
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
            torch.set_grad_enabled(grad)
        for sig, handler in self.signals.items():
            if handler is not None:
                signal.signal(sig, handler)
        warnings.filters[:] = self.warning_filters
        warnings._filters_mutated()  # noqa: SLF001 — drops the per-module "once" registries
        root = logging.getLogger()
        root.setLevel(self.root_logger[0])
        root.handlers[:] = self.root_logger[1]

    def left(self) -> list[str]:
        out = [f"process group: {what}" for what in _process_groups_left()]
        out += [f"megatron-core: {what}" for what in megatron_state.left()]
        out += [f"thread {t.name!r} still running" for t in threading.enumerate()
                if t.ident not in self.threads and not t.daemon and t.is_alive()]
        if torch.cuda.is_initialized():
            out.append("CUDA initialized (its context, allocator and RNG stay with the process)")
        dynamo = sys.modules.get("torch._dynamo.utils")
        if dynamo is not None and dynamo.counters:
            out.append("torch.compile's counters were not reset")
        if _torch_settings() != self.torch_settings:
            out.append(f"torch settings {_torch_settings()} (were {self.torch_settings})")
        return out


def _torch_settings() -> tuple:
    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), torch.is_grad_enabled())


def _gloo_threads() -> list[str]:
    """The native threads of live gloo contexts (a group that is gone leaves none)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(name for name in names if "gloo" in name)


def _process_groups_left() -> list[str]:
    out = ["the default group"] if dist.is_initialized() else []
    if distributed_c10d._world.pg_map:  # noqa: SLF001 — torch's registry of live groups
        out.append(f"{len(distributed_c10d._world.pg_map)} registered")  # noqa: SLF001
    deadline = time.monotonic() + 1.0
    while (threads := _gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)  # a destroyed group's threads end shortly after
    if threads:
        out.append(f"gloo threads {threads} (a group still referenced)")
    return out


def _drop_autograd_graphs() -> None:
    """Detach every tensor the call left with an autograd graph. Such a graph keeps the
    parameters' gradient accumulators alive from C++, and Python's collector does not look
    through an accumulator held twice: a module that stores one (megatron's MoE token
    dispatchers keep their last routing probabilities; its distributed optimizer keeps views
    of its fp32 parameters) then keeps its whole model — and the model its groups — out of
    reach of `gc.collect()`. A view cannot be detached in place: the lists and dicts holding
    it get a detached one instead. No one backpropagates through what a finished call left."""
    views = []
    for obj in gc.get_objects():  # (not what gc.freeze() kept from earlier calls)
        if issubclass(type(obj), torch.Tensor) and obj.grad_fn is not None:
            try:
                obj.detach_()
            except RuntimeError:  # a view
                views.append(obj)
    while views:
        view = views.pop()
        detached = view.detach()
        for holder in gc.get_referrers(view):
            if isinstance(holder, list):
                holder[:] = [detached if item is view else item for item in holder]
            elif isinstance(holder, dict):  # (optimizer states are keyed by parameter)
                if any(key is view for key in holder):
                    holder[detached] = holder.pop(view)
                holder.update({k: detached for k, item in holder.items() if item is view})


def _end_call(fresh: _FreshState) -> list[str]:
    """Leave this call's world and put the process back as `fresh`; what could not be."""
    megatron_state.reset()  # before the default group: it destroys its own gloo groups
    if dist.is_initialized():
        dist.destroy_process_group()
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        # what torch.compile compiled in this call (megatron compiles its MoE router's
        # `_apply_expert_bias` on first use): its guards hold the call's modules and groups,
        # and its counters would tell the next call it compiled. After the reset the next
        # call compiles what it uses, as a fresh process does.
        dynamo.reset()
        dynamo.utils.counters.clear()
    _drop_autograd_graphs()
    gc.collect()  # this call's models, groups and store clients
    # what survived (modules, caches) is not traversed again: the next call's collection
    # covers that call's objects only (~0.5 s less per call with megatron imported)
    gc.freeze()
    fresh.restore()
    return fresh.left()


def _pool_main(slot: int, env: dict[str, str], tasks, results) -> None:
    """A reused rank: run each call `tasks` brings, as rank `slot`, until told to stop (None)
    or the parent is gone."""
    os.environ.update(env)

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fresh = _FreshState.capture()
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                results.cancel_join_thread()
                return
            continue
        if task is None:
            return
        call, payload, world_size, store_port, init_default_group, environ, cwd, path = task
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path  # the parent's: where fn's module is found, as a spawn would have it
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        results.put((_RESULT, call, slot, _call_rank(lambda: pickle.loads(payload), slot,
                                                      world_size, store_port,
                                                      init_default_group)))
        try:  # while the parent reads the results: it waits for this before the next call
            left = _end_call(fresh)
        except BaseException:  # noqa: BLE001 — a reset that fails retires the process
            left = [f"the reset failed:\n{traceback.format_exc()}"]
        results.put((_RESET, call, slot, left))
        if left:  # retired: the pool starts a fresh process in this slot
            results.close()
            results.join_thread()  # the report is out
            os._exit(0)  # now, whatever threads the call left running


@dataclass
class _Slot:
    process: Any
    tasks: Any


def _stop_slots(slots: list[_Slot], kill: bool) -> None:
    for slot in slots:
        if kill and slot.process.is_alive():
            slot.process.kill()
        elif not kill:
            with contextlib.suppress(Exception):
                slot.tasks.put(None)
    _reap([slot.process for slot in slots])
    for slot in slots:
        slot.tasks.cancel_join_thread()  # a killed reader leaves the feeder nothing to flush to
        slot.tasks.close()
    slots.clear()


class RankPool:
    """Spawned gloo ranks that run one call after another: `run(fn, world_size, ...)` is
    `run_on_ranks` (same arguments, results, errors and deadline) on processes started once.

    A call of world size N runs on the pool's processes 0..N-1 (started as needed, so one
    pool serves every world size), each given the call over its own queue with a fresh
    rendezvous store (`MCORE_RL_STORE_PORT`), the parent's current environment, working
    directory and `sys.path`, and with `init_default_group` a default group of its own.
    After the call each process leaves its world and is put back as it was before its first
    call: megatron-core's groups, globals and caches (`compat.megatron_state`), every process
    group, what torch.compile compiled and counted, the autograd graphs the call left
    (`_drop_autograd_graphs`), the environment, working directory, torch/numpy/Python RNG
    state, torch's default dtype, determinism and grad mode, signal handlers, warning filters
    and the root logger. It then checks that no process group (gloo threads included),
    megatron state, new thread, CUDA context or changed torch setting survived; a process
    that fails the check retires and its slot gets a fresh process (`retired` says why).

    A call that fails, hangs or loses a rank ends the whole pool (the hung ranks' stacks are
    dumped and the error names them, as `run_on_ranks` does): the next call starts fresh
    processes. So does a change in the parent's environment (beyond `_VOLATILE_ENV`), which
    the processes inherited when they started. `env` is applied once, when each process
    starts (CUDA_VISIBLE_DEVICES must precede CUDA's first use): one pool per spawn env.
    Modules stay imported between calls — a call that tests import-time or other
    process-level behaviour belongs in fresh processes (`run_on_ranks(fresh_processes=True)`).
    """

    # how long a rank may take to leave a call's world before the next call
    RESET_TIMEOUT_S = 60.0

    def __init__(self, env: dict[str, str] | None = None):
        self.env = dict(env or {})
        self.retired: list[str] = []
        self._ctx = mp.get_context("spawn")
        self._slots: list[_Slot] = []
        self._results = None
        self._resetting: set[int] = set()  # ranks of the last call not yet put back
        self._inherited: dict[str, str] | None = None
        self._calls = itertools.count()
        self._lock = threading.Lock()
        # ends the processes if the pool is dropped without close(), and at exit: run by
        # multiprocessing's exit handler before it joins its children (which would wait for
        # these forever)
        mp_util.Finalize(self, _stop_slots, args=(self._slots, False), exitpriority=10)

    @property
    def pids(self) -> list[int]:
        """The processes' ids, by rank (tests use them to see reuse)."""
        return [s.process.pid for s in self._slots]

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0,
            init_default_group: bool = True, **kwargs: Any) -> list[Any]:
        with self._lock:
            # pickled per rank (a shared tensor's fd is handed out once), all before any rank
            # is sent its call: a pickling error must not leave some ranks waiting for peers
            payloads = [bytes(ForkingPickler.dumps((fn, args, kwargs)))
                        for _ in range(world_size)]
            self._ensure(world_size)
            store = listening_store("127.0.0.1", 0, world_size + 1, timeout_s=60)
            call = next(self._calls)
            environ = {**os.environ, **_child_env(store.port, self.env)}
            for rank, payload in enumerate(payloads):
                self._slots[rank].tasks.put((call, payload, world_size, store.port,
                                             init_default_group, environ, os.getcwd(),
                                             list(sys.path)))
            self._resetting = set(range(world_size))

            def receive(timeout: float) -> RankResult:
                end = time.monotonic() + timeout
                while True:  # a rank done early reports its reset while peers still run
                    kind, got, rank, body = self._results.get(
                        timeout=max(0.0, end - time.monotonic()))
                    if got != call:  # _ensure read every earlier message
                        raise RuntimeError(f"RankPool: a {kind} of call {got} during {call}")
                    if kind == _RESULT:
                        return body
                    self._reset_done(rank, body)

            try:
                collected = _collect([s.process for s in self._slots[:world_size]], receive,
                                     timeout_s)
            except BaseException:
                self._stop(kill=True)
                raise
            if not all(r.ok for r in collected.values()):
                self._stop(kill=True)  # peers may be stuck in a collective, or half reset
            del store
        return _values(collected, world_size)

    def close(self) -> None:
        with self._lock:
            self._stop(kill=False)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ensure(self, world_size: int) -> None:
        """Ranks 0..world_size-1 alive, put back after the last call, in the parent's
        current environment."""
        self._await_resets()
        inherited = {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}
        if self._slots and inherited != self._inherited:
            changed = sorted(k for k in inherited.keys() | self._inherited.keys()
                             if inherited.get(k) != self._inherited.get(k))
            self.retired.append(f"the parent's environment changed ({', '.join(changed)}): "
                                "its processes started with the old one")
            self._stop(kill=False)
        if not self._slots:
            self._results, self._inherited = self._ctx.Queue(), inherited
        for rank in range(world_size):
            if rank < len(self._slots) and self._slots[rank].process.is_alive():
                continue
            if rank < len(self._slots):  # retired or died between calls
                self._slots[rank].process.join(timeout=5.0)
            tasks = self._ctx.Queue()
            process = self._ctx.Process(
                target=_pool_main, daemon=False, name=f"pooled-rank{rank}",
                args=(rank, _child_env(None, self.env), tasks, self._results))
            process.start()
            if rank < len(self._slots):
                self._slots[rank] = _Slot(process, tasks)
            else:
                self._slots.append(_Slot(process, tasks))

    def _await_resets(self) -> None:
        """Read each rank's reset report of the last call; a rank that could not be put back
        retires (it exits itself), one that takes too long or died ends the pool."""
        deadline = time.monotonic() + self.RESET_TIMEOUT_S
        while self._resetting:
            try:
                kind, _, rank, left = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r in self._resetting if not self._slots[r].process.is_alive()]
                if dead or time.monotonic() > deadline:
                    why = (f"ranks {sorted(self._resetting)} did not leave their world within "
                           f"{self.RESET_TIMEOUT_S:.0f} s" if not dead else
                           f"ranks {dead} died leaving their world")
                    self._retire_all(why)
                continue
            if kind != _RESET:
                raise RuntimeError(f"RankPool: a {kind} message while awaiting resets")
            self._reset_done(rank, left)

    def _reset_done(self, rank: int, left: list[str]) -> None:
        """Rank `rank` left its call's world; `left`: what it could not put back (it retires:
        the process exits itself)."""
        self._resetting.discard(rank)
        if not left:
            return
        why = f"rank {rank} (pid {self._slots[rank].process.pid}): " + "; ".join(left)
        self.retired.append(why)
        warnings.warn(f"RankPool: a process was not reused: {why}", stacklevel=2)
        _reap([self._slots[rank].process])

    def _retire_all(self, why: str) -> None:
        self.retired.append(why)
        warnings.warn(f"RankPool: processes were not reused: {why}", stacklevel=2)
        self._stop(kill=True)

    def _stop(self, kill: bool) -> None:
        _stop_slots(self._slots, kill)
        self._results = None  # a new queue with the next processes: no stale messages
        self._resetting = set()


_pools: dict[tuple, RankPool] | None = None


@contextlib.contextmanager
def pooled_ranks():
    """While open, `run_on_ranks` runs its calls on `RankPool`s (one per spawn env) that live
    until the block ends, unless a call asks for `fresh_processes`. The test session opens
    one (tests/conftest.py); nested blocks share the outermost one's pools."""
    global _pools
    if _pools is not None:
        yield
        return
    _pools = {}
    try:
        yield
    finally:
        pools, _pools = _pools, None
        for pool in pools.values():
            pool.close()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0,
                 init_default_group: bool = True, env: dict[str, str] | None = None,
                 fresh_processes: bool = False, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` spawned gloo ranks.

    `fn` must be importable (module level). Returns the per-rank return values in rank order.
    Raises DistributedRunError naming the failing or hung ranks, with their tracebacks.
    With `init_default_group=False` the children get `MCORE_RL_STORE_PORT` and build
    whatever groups they need themselves (e.g. a trainer world plus a separate sync group).
    Inside `pooled_ranks()` the call runs on a reused `RankPool`; `fresh_processes=True`
    spawns new processes all the same (for a caller testing process-level behaviour).
    """
    if _pools is not None and not fresh_processes:
        key = tuple(sorted((env or {}).items()))
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = RankPool(env)
        return pool.run(fn, world_size, *args, timeout_s=timeout_s,
                        init_default_group=init_default_group, **kwargs)
    ctx = mp.get_context("spawn")
    store = listening_store("127.0.0.1", 0, world_size + 1, timeout_s=60)
    child_env = _child_env(store.port, env)
    results = ctx.Queue()
    procs = [ctx.Process(target=_child_main, daemon=False, name=f"rank{rank}",
                         args=(fn, rank, world_size, store.port, init_default_group, child_env,
                               args, kwargs, results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        collected = _collect(procs, lambda timeout: results.get(timeout=timeout), timeout_s)
    finally:
        _reap(procs)
    return _values(collected, world_size)


def _values(collected: dict[int, RankResult], world_size: int) -> list[Any]:
    failures = [r for r in collected.values() if not r.ok]
    if failures:
        detail = "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in failures)
        raise DistributedRunError(f"ranks {[r.rank for r in failures]} failed:\n{detail}")
    return [collected[r].value for r in range(world_size)]


def _collect(procs, receive: Callable[[float], RankResult],
             timeout_s: float) -> dict[int, RankResult]:
    deadline = time.monotonic() + timeout_s
    collected: dict[int, RankResult] = {}
    while len(collected) < len(procs):
        try:
            r = receive(0.2)
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
                if procs[rank].is_alive():  # stack dumped: nothing left to wait for
                    procs[rank].kill()
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
