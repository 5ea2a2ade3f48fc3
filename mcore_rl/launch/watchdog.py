"""Hang diagnosis: every worker process can dump its Python stacks on demand, and the
controller turns a missed deadline into an error that names the phase, the workers that did
not arrive, and where their stacks are — instead of a silent hang or a bare gloo/NCCL timeout.

Workers call `arm_stack_dump` once at start (faulthandler on SIGUSR1 into
STACK_DIR/<name>.stack.txt); the controller calls `dump_stacks` with every worker's pid when a
phase misses its deadline. `maybe_stall` is the fault-injection point the watchdog tests use to
stall one worker on purpose ("<phase>@<worker>", e.g. "update_actor@rank1" or "gen@engine0").
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import Callable, Mapping

STACK_SIGNAL = signal.SIGUSR1
# When a worker dies, its peers' collectives fail too (gloo: "Connection closed by peer"), and
# a peer's error can arrive before Ray reports the death: a worker's error waits this long for
# another worker's death, which is then the error named.
DEATH_GRACE_S = 5.0


class WatchdogTimeout(RuntimeError):
    """A phase missed its deadline. `phase`, `late` (worker names) and `stacks` (paths)."""

    def __init__(self, phase: str, deadline_s: float, late: list[str], stacks: list[Path],
                 detail: str = ""):
        self.phase, self.late, self.stacks = phase, late, stacks
        where = f"; stack dumps: {', '.join(str(p) for p in stacks)}" if stacks else ""
        super().__init__(f"watchdog: phase {phase!r} missed its {deadline_s:.0f} s deadline; "
                         f"did not arrive: {', '.join(late) or 'unknown'}"
                         f"{'; ' + detail if detail else ''}{where}")


class WorkerDied(RuntimeError):
    """A worker process died during a phase; names it (role, rank, pid) and the phase."""


def collect_or_name_dead(refs: list, deadline_s: float, phase: str,
                         pids: list[int] | None = None, role: str = "actor rank") -> dict:
    """ray.get of every ref within `deadline_s`, taking results as they arrive: index ->
    value for those that finished in time. A worker whose process died raises WorkerDied
    naming it at once; another error of a worker is re-raised as Ray gives it, unless another
    worker turns out dead within `DEATH_GRACE_S` (the error was its peer's: WorkerDied)."""
    import ray  # lazy: ray
    from ray.exceptions import RayActorError  # lazy: ray

    def died(i: int, err: Exception) -> WorkerDied:
        pid = f" (pid {pids[i]})" if pids and i < len(pids) else ""
        return WorkerDied(f"{role} {i}{pid} died during phase {phase!r}: "
                          f"{str(err).splitlines()[0][:300]}")

    index = {ref: i for i, ref in enumerate(refs)}
    values, pending = {}, list(refs)
    end = time.monotonic() + deadline_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=max(0.0, end - time.monotonic()))
        if not ready:
            break
        for ref in ready:
            i = index[ref]
            try:
                values[i] = ray.get(ref)
            except RayActorError as err:
                raise died(i, err) from err
            except Exception as err:
                grace = min(DEATH_GRACE_S, max(0.0, end - time.monotonic()))
                dead = _first_death(pending, index, grace)
                if dead is None:
                    raise
                raise died(*dead) from err
    return values


def _first_death(pending: list, index: dict, timeout_s: float) -> tuple[int, Exception] | None:
    """(worker index, its error) of the first of `pending` whose worker died within
    `timeout_s`; None when none did (the others answered, failed otherwise, or are late)."""
    import ray  # lazy: ray
    from ray.exceptions import RayActorError  # lazy: ray

    end = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=max(0.0, end - time.monotonic()))
        if not ready:
            return None
        try:
            ray.get(ready[0])
        except RayActorError as err:
            return index[ready[0]], err
        except Exception:  # noqa: BLE001 — another worker's own error: not a death
            pass
    return None


def still_running(late_calls: Mapping[int, object]) -> set[int]:
    """The workers (index -> the Ray call that missed its deadline) still inside that call.
    A Ray actor runs one call at a time: such a worker answers nothing else (a clean shutdown
    included) until it returns."""
    import ray  # lazy: ray

    return {i for i, ref in late_calls.items() if not ray.wait([ref], timeout=0)[0]}


def stack_file(stack_dir: str | Path, name: str) -> Path:
    return Path(stack_dir) / f"{name}.stack.txt"


def arm_stack_dump(stack_dir: str | Path, name: str):
    """Dump all threads' Python stacks to STACK_DIR/<name>.stack.txt on SIGUSR1. Returns the
    open file (keep a reference: faulthandler writes to its descriptor)."""
    path = stack_file(stack_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("w")
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
    return handle


def dump_stacks(pids: Mapping[str, int], stack_dir: str | Path,
                wait_s: float = 3.0) -> list[Path]:
    """Signal every worker to dump its stacks; return the dump files that were written."""
    for pid in pids.values():
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    paths = {name: stack_file(stack_dir, name) for name in pids}
    while time.monotonic() < deadline:
        if all(p.is_file() and p.stat().st_size for p in paths.values()):
            break
        time.sleep(0.1)
    return [p for p in paths.values() if p.is_file() and p.stat().st_size]


class Watchdog:
    """The run's processes, by name, as they start: a missed deadline (`timeout`) makes
    every one of them dump its stacks and names the phase and who is late. Usable from the
    first worker on: whatever has not started yet is simply not named."""

    def __init__(self, stack_dir: str | Path):
        self.stack_dir = Path(stack_dir)
        self._groups: list[tuple[str, Callable[[], list[int]]]] = []

    def watch(self, prefix: str, pids: Callable[[], list[int]]) -> None:
        """A group of workers named `<prefix><i>`; `pids()` is asked at each timeout (an
        engine restarted since has a new pid)."""
        self._groups.append((prefix, pids))

    def timeout(self, phase: str, deadline_s: float, late: list[str],
                detail: str = "") -> WatchdogTimeout:
        """Every watched worker dumps its stacks; the error names the phase, the late
        workers and the dump files."""
        pids = {f"{prefix}{i}": pid for prefix, group in self._groups
                for i, pid in enumerate(group())}
        return WatchdogTimeout(phase, deadline_s, late, dump_stacks(pids, self.stack_dir),
                               detail)


def maybe_stall(phase: str, worker: str, inject: str | None) -> None:
    """Fault injection for watchdog tests: block forever if `inject` == "<phase>@<worker>"."""
    if inject and inject == f"{phase}@{worker}":
        while True:
            time.sleep(3600)
