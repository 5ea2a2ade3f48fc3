"""CPU seconds by role: a real process tree (a child titled like a Ray engine actor, whose
own child burns CPU), read from the parent."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from mcore_rl.launch.process_cpu import cpu_by_role, cpu_floor_s, role_of

# the child names itself like Ray's engine actor, starts a grandchild that burns ~0.6 s of
# CPU and reports it, then both stay alive until stdin closes
CHILD = textwrap.dedent("""
    import subprocess, sys
    import setproctitle
    setproctitle.setproctitle("ray::EngineHost.generate")
    burn = "import time, sys\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\nprint('burnt', flush=True)\\nsys.stdin.read()"
    grandchild = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    print(grandchild.stdout.readline().strip(), flush=True)
    sys.stdin.read()
    grandchild.stdin.close()
    grandchild.wait()
""")


@pytest.mark.parametrize("title,role", [
    ("ray::ActorWorker.update", "actor ranks"), ("ray::ActorWorker", "actor ranks"),
    ("ray::EngineHost", "engines"), ("ray::RewardWorker.score", "reward model"),
    ("ray::IDLE", None), ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet",
                          None),
])
def test_roles_come_from_ray_process_titles(title, role):
    assert role_of(title) == role


def test_a_grandchild_counts_for_the_role_of_its_titled_parent():
    before = cpu_by_role()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "burnt"
        time.sleep(0.1)
        after = cpu_by_role()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert after.get("engines", 0.0) - before.get("engines", 0.0) >= 0.55, after
    assert after["total"] == pytest.approx(sum(v for k, v in after.items() if k != "total"),
                                           abs=0.05)
    assert after["driver"] >= before["driver"]


def test_the_floor_spreads_the_cpu_over_the_cores():
    assert cpu_floor_s(42.0, cores=2) == 21.0
    assert cpu_floor_s(3.0) == pytest.approx(3.0 / len(os.sched_getaffinity(0)),
                                             abs=0.01)
