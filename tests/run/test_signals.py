"""mcore_rl.run.signals's local Ray: started deaf to the process group's SIGTERM and SIGINT
(a terminal's Ctrl-C), and
stopped at once and completely by `stop_local_ray` (SIGKILL instead of a SIGTERM Ray would wait
on, then the raylet's agents, which would outlive it); the demo model built beside its start.

Ray runs in a child interpreter: the signal mask and Ray's global node are process state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.run import lifecycle
from mcore_rl.run.lifecycle import model_dir_while_ray_starts
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED

_SCRIPT = r"""
import json, signal, subprocess, time
import psutil
from mcore_rl.launch.ray_runtime import start_local_ray, stop_local_ray
import ray

start_local_ray()
started = [info.process for infos in ray._private.worker._global_node.all_processes.values()
           for info in infos]
procs = {p.pid: psutil.Process(p.pid) for p in started}
for p in started:
    procs.update({c.pid: c for c in psutil.Process(p.pid).children(recursive=True)})

def blocked_signals(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return all(mask >> (sig - 1) & 1 for sig in (signal.SIGTERM, signal.SIGINT))

blocked = {pid: blocked_signals(pid) for pid in procs}
timeouts = []
for p in started:  # what Ray's shutdown waits on: a timeout is a signal the process ignored
    def wait(timeout=None, _wait=p.wait, _name=p.args[0] if p.args else "?"):
        try:
            return _wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timeouts.append(_name)
            raise
    p.wait = wait
stop_local_ray()
deadline = time.monotonic() + 10
def alive():
    out = []
    for pid, proc in procs.items():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(proc.cmdline())[:80] or str(pid))
        except psutil.NoSuchProcess:
            pass
    return out
while alive() and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps({"n": len(procs), "blocked": sum(blocked.values()), "timeouts": timeouts,
                  "alive": alive(), "initialized": ray.is_initialized()}))
"""


def test_local_ray_ignores_sigterm_and_sigint_and_stop_ends_every_process_at_once():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["n"] >= 4  # GCS, raylet and their helpers and agents
    assert seen["blocked"] == seen["n"]  # the premise: none can receive SIGTERM or SIGINT
    assert seen["timeouts"] == []  # Ray never waited for a SIGTERM to be ignored
    assert seen["alive"] == []  # the raylet's agents too
    assert not seen["initialized"]


def test_a_bad_model_hf_dir_fails_before_ray_starts(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(lifecycle, "start_local_ray", lambda: started.append(True))
    cfg = load_config(RLConfig, DEMO_SIZED, [f"model.hf_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="model.hf_dir"):
        model_dir_while_ray_starts(cfg, tmp_path / "out")
    assert started == []


_CTRL_C = r"""
import os, signal, sys, time
from mcore_rl.run.signals import RunStopped, StopControl

stop = StopControl(grace_s=60).install()
first = signal.SIGTERM if sys.argv[1] == "term" else signal.SIGINT
os.kill(os.getpid(), first)
time.sleep(0.2)
print(stop.requested, stop.signal_name, RunStopped(4, stop.signal_name, "ckpt").exit_code,
      flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # a SIGTERM while stopping: already stopping
time.sleep(0.2)
print("still running", flush=True)
os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while stopping: out at once
time.sleep(10)
print("not reached", flush=True)
"""


@pytest.mark.parametrize("first", ["int", "term"])
def test_ctrl_c_stops_like_sigterm_with_exit_130_and_a_second_one_exits_at_once(first):
    """SIGINT is a stop request like SIGTERM (the run's RunStopped then exits 130, not 75);
    a Ctrl-C while stopping exits 130 at once, in one line, no traceback."""
    proc = subprocess.run([sys.executable, "-c", _CTRL_C, first], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    name, code = ("SIGINT", "130") if first == "int" else ("SIGTERM", "75")
    assert proc.stdout.splitlines() == [f"True {name} {code}", "still running"], proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith(f"mcore-rl: {name} received: stopping at the end of the "
                               "current step, then checkpoint (deadline 60 s")
    assert ("Ctrl-C again exits at once" in lines[0]) == (first == "int")
    assert lines[-1] == (f"mcore-rl: SIGINT again while stopping on {name}: exiting now "
                         "without a checkpoint (exit code 130)")
    assert lines[1] == "mcore-rl: SIGTERM again; already stopping"
    assert len(lines) == 3 and "Traceback" not in proc.stderr, proc.stderr


def test_a_ctrl_c_no_command_handles_is_one_line_and_exit_130(monkeypatch, tmp_path, capsys):
    """Outside a run's stop handling (imports, config loading, any other command): no
    KeyboardInterrupt traceback, one line, 128 + SIGINT."""
    from mcore_rl import cli
    from mcore_rl.run import train

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_plot", interrupted)
    assert cli.main(["plot", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "mcore-rl: interrupted (Ctrl-C); exit code 130\n"


_CTRL_C_TWICE_WITH_RAY = r"""
import json, os, signal, time
import psutil
from mcore_rl.launch.ray_runtime import start_local_ray
from mcore_rl.run.signals import StopControl
import ray

start_local_ray()
stop = StopControl(grace_s=60).install()
started = [info.process.pid for infos in ray._private.worker._global_node.all_processes.values()
           for info in infos]
pids = started + [c.pid for p in started for c in psutil.Process(p).children(recursive=True)]
print(json.dumps(pids), flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.2)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(30)
print("not reached", flush=True)
"""


def test_a_second_ctrl_c_leaves_no_ray_process_behind():
    """The exit at once of a second Ctrl-C kills the local Ray's processes first: the raylet's
    agents, which outlive a driver that just exits, go too."""
    import psutil

    proc = subprocess.run([sys.executable, "-c", _CTRL_C_TWICE_WITH_RAY], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 130, proc.stdout + proc.stderr[-3000:]
    pids = json.loads(proc.stdout.splitlines()[0])
    assert len(pids) >= 6, pids  # GCS, raylet, their helpers, the raylet's agents

    def alive():
        out = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive() == []
