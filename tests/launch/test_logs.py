"""Quiet console (issue #18): in a process that called `configure_process_logs`, library
logging and warnings land in RUN_DIR/logs/<role>-<pid>.log and not on the console — megatron's
TE/apex import warnings, Ray's and vLLM's INFO lines, and vLLM processes started afterwards
(their own files); `MCORE_RL_VERBOSE=1` leaves everything on the console. One subprocess per
mode, as a fresh process is what each hook sees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROCESS = r"""
import logging, multiprocessing, sys
from mcore_rl.launch.logs import configure_process_logs, reapply_process_logs

def vllm_logging():  # what vLLM does in each process it runs in (LLM(), its TP workers)
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    configure_logging(LoggingConfig())
    return init_logger

def vllm_child():  # a process vLLM starts itself: it reads VLLM_LOGGING_CONFIG_PATH
    vllm_logging()("vllm.worker").info("child: Successfully reset prefix cache")

if __name__ == "__main__":
    path = configure_process_logs(sys.argv[1], "driver")
    import megatron.core.optimizer  # warns: Transformer Engine and Apex are not installed
    import ray  # installs its own stderr handler on the "ray" logger at import
    reapply_process_logs()  # again, after the imports (what init_local_ray does): idempotent
    logging.getLogger("ray").info("ray: Started a local Ray instance")
    from transformers.utils.logging import tqdm  # save_pretrained's shard bar
    for _ in tqdm(range(3), desc="Writing model shards"):
        pass
    vllm_logging()("vllm.engine").info("Successfully reset prefix cache")
    child = multiprocessing.get_context("spawn").Process(target=vllm_child)
    child.start(); child.join()
    print("step 1 reward 0.5", flush=True)
    print(f"log file: {path}")
"""
NOISE = ("Transformer Engine and Apex are not installed", "ray: Started a local Ray instance",
         "Successfully reset prefix cache", "Writing model shards")


def _run(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "process.py"
    script.write_text(PROCESS)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    # what an earlier in-process run of this worker left behind (configure_process_logs sets
    # both): the subprocess stands for a fresh process
    full_env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    full_env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    return subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=full_env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.fixture(scope="module")
def quiet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quiet")
    return tmp, _run(tmp, MCORE_RL_VERBOSE="0")


def test_quiet_console_shows_only_the_runs_lines(quiet):
    tmp, proc = quiet
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    for line in NOISE:
        assert line not in console, console
    assert "step 1 reward 0.5" in proc.stdout
    logs = tmp / "run" / "logs"
    driver = [p for p in logs.glob("driver-*.log")]
    assert len(driver) == 1 and f"log file: {driver[0]}" in proc.stdout
    text = driver[0].read_text()
    assert "WARNING py.warnings:" in text and NOISE[0] in text
    assert "INFO ray: ray: Started" in text
    assert text.count("ray: Started a local Ray instance") == 1  # one handler per logger
    # vLLM's logger: its own file per process, the driver's and the spawned child's
    pid = driver[0].stem.split("-")[1]
    vllm = {p.stem.split("-")[1]: p.read_text() for p in logs.glob("vllm-*.log")}
    assert len(vllm) == 2 and "Successfully reset prefix cache" in vllm.pop(pid)
    assert "child: Successfully reset prefix cache" in vllm.popitem()[1]


def test_verbose_leaves_library_logs_on_the_console(tmp_path):
    proc = _run(tmp_path, MCORE_RL_VERBOSE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Transformer Engine and Apex are not installed" in proc.stderr
    assert "ray: Started a local Ray instance" in proc.stderr
    assert "Writing model shards" in proc.stderr
    assert "Successfully reset prefix cache" in proc.stdout  # vLLM logs to stdout
    assert "child: Successfully reset prefix cache" in proc.stdout
    assert "log file: None" in proc.stdout and not (tmp_path / "run" / "logs").exists()
