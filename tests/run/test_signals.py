"""mcore_rl.run.signals's local Ray: started deaf to the process group's SIGTERM, and
stopped at once and completely by `stop_local_ray` (SIGKILL instead of a SIGTERM Ray would wait
on, then the raylet's agents, which would outlive it); the demo model built beside its start.

Ray runs in a child interpreter: the signal mask and Ray's global node are process state.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.launch import ray_runtime
from mcore_rl.run.train import model_dir_while_ray_starts
from mcore_rl.run.config import RLConfig
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

def sigterm_blocked(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)

blocked = {pid: sigterm_blocked(pid) for pid in procs}
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


def test_local_ray_ignores_sigterm_and_stop_ends_every_process_without_waiting_on_it():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["n"] >= 4  # GCS, raylet and their helpers and agents
    assert seen["blocked"] == seen["n"]  # the premise: none of them can receive SIGTERM
    assert seen["timeouts"] == []  # Ray never waited for a SIGTERM to be ignored
    assert seen["alive"] == []  # the raylet's agents too
    assert not seen["initialized"]


def test_a_bad_model_hf_dir_fails_before_ray_starts(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(ray_runtime, "start_local_ray", lambda: started.append(True))
    cfg = load_config(RLConfig, DEMO_SIZED, [f"model.hf_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="model.hf_dir"):
        model_dir_while_ray_starts(cfg, tmp_path / "out")
    assert started == []
