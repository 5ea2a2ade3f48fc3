"""One local Ray for the pytest session, and the check that a test leaves nothing in it.

Starting a local Ray costs ~4 s on the 2-core CI machine and stopping it ~1.5 s; each RL test
used to pay both, its controller starting and stopping its own. Now the first test that asks
for `ray_cluster` (or a module fixture that asks for `ray_session`) starts one with
`init_local_ray`, bound to loopback as a run's is; a controller finds it up and leaves it up
(`RLController.owns_ray`), and it is stopped after the last test that asked for it (a later
test that starts a controller without asking gets a Ray of its own, as before). On parallel
workers (scripts/test.sh) each worker has its own session Ray; one whose last user ran on
another worker stops when its worker's session ends.

A shared Ray is only as good as its tests' clean-up: `leaves_nothing` fails the test (or the
module fixture) that leaves an actor, a placement group or a process behind — an actor rank
not killed, an engine's TP worker orphaned by its engine's death. Processes are found by a
tag the session's Ray inherits (its raylet, so every worker and everything a worker starts)
and by descent from this process; Ray's own idle workers are not the test's.

Tests that need a Ray of their own — its signal mask, its stop killing every process, a Ray
process killed under it — start it in a child interpreter (tests/run/test_signals.py).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass, field

import pytest

TAG = "MCORE_RL_TEST_RAY_SESSION"  # in the environment of the session Ray's processes
SETTLE_S = 30.0  # how long a stopped actor, group or process may take to be gone


@dataclass
class SessionRay:
    """The session's Ray: started on first use, stopped after `last_user` (a node id)."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    last_user: str | None = None
    running: bool = False

    def start(self) -> None:
        from mcore_rl.launch.ray_runtime import init_local_ray

        if self.running:
            return
        # the tag reaches the raylet (hence every worker) but no later child of this process;
        # Ray's memory monitor kills actors when the *machine* passes 95 %, which on a shared
        # test box is other people's processes: OOM handling is left to the kernel here
        extra = {TAG: self.tag, "RAY_memory_monitor_refresh_ms": "0"}
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            if not init_local_ray(num_cpus=max(2, os.cpu_count() or 2)):
                raise RuntimeError("Ray was initialized before the session's Ray: a test "
                                   "started its own and left it up")
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.running = True

    def stop(self) -> None:
        from mcore_rl.launch.ray_runtime import stop_local_ray

        if self.running:
            self.running = False
            stop_local_ray()


_KEY = pytest.StashKey[SessionRay]()


@pytest.fixture(scope="session")
def ray_session(request):
    """The session's local Ray (started here on first use; see the module doc)."""
    users = [item.nodeid for item in request.session.items
             if "ray_session" in item.fixturenames]
    session = request.config.stash.setdefault(_KEY, SessionRay())
    session.last_user = users[-1] if users else None
    session.start()
    yield session
    session.stop()


@pytest.fixture
def ray_cluster(ray_session):
    """The session's Ray for one test, which must leave no actor, placement group or process
    of its own in it. Started again if it was stopped after its `last_user`: a worker may run
    its files in another order than the session's collection lists them."""
    ray_session.start()
    with leaves_nothing(ray_session, "this test"):
        yield ray_session


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses the session's Ray (its fixtures torn down): stop it,
    rather than keep its processes up through the rest of the run."""
    session = item.config.stash.get(_KEY, None)
    if session is not None and item.nodeid == session.last_user:
        session.stop()


@dataclass(frozen=True)
class Seen:
    """What lives in the session's Ray, by id: a line naming each."""

    actors: dict[str, str]
    groups: dict[str, str]
    processes: dict[int, str]

    def minus(self, before: Seen) -> list[str]:
        return ([line for key, line in self.actors.items() if key not in before.actors]
                + [line for key, line in self.groups.items() if key not in before.groups]
                + [line for key, line in self.processes.items()
                   if key not in before.processes])


def seen(session: SessionRay) -> Seen:
    """The actors not dead, the placement groups not removed, and the live processes under
    the session's Ray or this process (Ray's idle workers left out)."""
    import psutil
    import ray

    actors = {key: f"actor {a['ActorClassName']} (pid {a['Pid']}, {a['State']})"
              for key, a in ray._private.state.actors().items() if a["State"] != "DEAD"}
    groups = {key: f"placement group {key} ({g['state']}, bundles {g['bundles']})"
              for key, g in ray.util.placement_group_table().items()
              if g["state"] != "REMOVED"}
    processes = {p.pid: p for p in psutil.Process().children(recursive=True)}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid not in processes and proc.environ().get(TAG) == session.tag:
                processes[proc.pid] = proc
    named = {}
    for pid, proc in processes.items():
        with contextlib.suppress(psutil.Error):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(proc.cmdline())
            if line.startswith("ray::IDLE") or "default_worker.py" in line:
                continue  # Ray's worker pool: started by Ray, for whoever comes next
            named[pid] = f"process {pid}: {line[:160]}"
    return Seen(actors, groups, named)


@contextlib.contextmanager
def leaves_nothing(session: SessionRay, who: str):
    """Fails `who` if an actor, a placement group or a process that was not there when the
    block began is still there `SETTLE_S` after it ended."""
    before = seen(session)
    yield
    deadline = time.monotonic() + SETTLE_S
    while (left := seen(session).minus(before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        pytest.fail(f"{who} left {len(left)} thing(s) behind in the session's Ray or this "
                    f"process, {SETTLE_S:.0f} s after it ended:\n  " + "\n  ".join(left),
                    pytrace=False)
