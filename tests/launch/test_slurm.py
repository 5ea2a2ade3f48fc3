"""The project's sbatch scripts on a real (one-node, CPU) SLURM cluster.

The session fixture starts the cluster with scripts/ci_slurm.sh (installing slurm + munge when
missing — CI runs as root) and stops it at the end unless it was already running or still
has jobs (another session's). Each job is
submitted with `sbatch --wait` under `timeout`; a job still running after its deadline is
cancelled. Skipped only where the cluster cannot exist: not root and no `sbatch` installed
(never in CI: CI=1 turns that into a failure).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI_SLURM = ROOT / "scripts" / "ci_slurm.sh"
SBATCH_DIR = ROOT / "scripts" / "slurm"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(cmd, *, timeout, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """SLURM_CONF of a running local cluster; the environment jobs are submitted with."""
    if os.geteuid() != 0 and shutil.which("sbatch") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run as root: the SLURM tests install and start a cluster")
        pytest.skip("no SLURM here and not root (scripts/ci_slurm.sh needs root)")
    scratch = os.environ.get("SLURM_CI_DIR", "/tmp/mcore-rl-slurm")
    env = {**os.environ, "SLURM_CI_DIR": scratch, "SLURM_CONF": f"{scratch}/slurm.conf"}
    was_up = (Path(scratch, "slurm.conf").exists()
              and _run(["bash", str(CI_SLURM), "status"], timeout=30, env=env).returncode == 0)
    started = _run(["bash", str(CI_SLURM), "start"], timeout=900, env=env)
    assert started.returncode == 0, f"ci_slurm.sh start failed:\n{started.stderr}"
    cpus = _run(["sinfo", "-h", "-o", "%c"], timeout=30, env=env).stdout.split()
    assert cpus and int(cpus[0]) >= 2, \
        f"the test cluster's node has {cpus} CPUs; the jobs here need 2 (see {scratch}/slurm.conf)"
    job_env = {**env, "MCORE_RL_ROOT": str(ROOT), "MCORE_RL_PYTHON": sys.executable}
    yield job_env
    queue = _run(["squeue", "-h"], timeout=30, env=env).stdout.strip()
    if not was_up and not queue:  # leave a cluster that was up before, or is still in use
        stopped = _run(["bash", str(CI_SLURM), "stop"], timeout=120, env=env)
        assert stopped.returncode == 0, stopped.stderr


def sbatch(env, script, *args, out: Path, options=(), timeout=300, extra_env=None):
    """Submit and wait; returns (exit code, job id, job output)."""
    cmd = ["timeout", str(timeout), "sbatch", "--wait", "--parsable", f"--output={out}",
           *options, str(SBATCH_DIR / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**env, **(extra_env or {})}, timeout=timeout + 30)
    job = proc.stdout.split(";")[0].strip().splitlines()[0] if proc.stdout.strip() else ""
    if proc.returncode == 124 and job:  # our deadline, not the job's exit code
        subprocess.run(["scancel", job], env=env, timeout=30)
    log = out.read_text() if out.exists() else ""
    assert proc.returncode != 124, f"job {job} ({script}) missed its {timeout} s deadline:\n{log}"
    assert job.isdigit(), f"sbatch did not submit {script}: {proc.stderr}"
    return proc.returncode, job, log


def _ray_processes_of(job: str) -> list[str]:
    """Command lines of live processes that belong to the job's Ray (its temp dir or port)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"/tmp/ray-{job}/" in text or f"/tmp/ray-{job} " in text:
            found.append(text[:200])
    return found


TRAIN_STEPS = 4


@pytest.fixture(scope="session")
def train_run(slurm, tmp_path_factory):
    """The tiny config trained by train.sbatch (one node: Ray head + driver, 2 actor ranks),
    stopped once by the time-limit path: SLURM's `--signal=B:USR1@N` (here sent as soon as
    step 1 is logged with `scancel --batch --signal=USR1`, exactly what the time limit sends)
    reaches the batch script, which forwards it; the run checkpoints after its current step
    and exits 75; the script requeues the job, and the requeued run (same job id, same
    RUN_DIR) resumes by itself. Returns (exit code, job, log, run dir, seconds from the signal
    to the end of both runs)."""
    tmp = tmp_path_factory.mktemp("slurm_train")
    run_dir, out = tmp / "run", tmp / "train.out"
    cmd = ["timeout", "300", "sbatch", "--wait", "--parsable", f"--output={out}",
           str(SBATCH_DIR / "train.sbatch"), "configs/tiny_ci.yaml", f"steps={TRAIN_STEPS}"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**slurm, "RUN_DIR": str(run_dir)})
    job = proc.stdout.readline().strip().split(";")[0]
    assert job.isdigit(), proc.stderr.read()
    metrics = run_dir / "metrics.jsonl"
    try:
        # a step logged (the evaluation of the starting weights comes first, as step 0)
        while not (metrics.is_file() and '"reward_mean"' in metrics.read_text()):
            assert proc.poll() is None, out.read_text()[-4000:]
            assert time.monotonic() - started < 240, "no step logged within 240 s"
            time.sleep(0.1)
        signalled = time.monotonic()
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True,
                       timeout=30)
        code = proc.wait(timeout=330)
    finally:
        if proc.poll() is None:
            subprocess.run(["scancel", job], env=slurm, timeout=30)
            proc.kill()
    return code, job, out.read_text(), run_dir, time.monotonic() - signalled


def test_train_job_runs_its_steps_and_stops_ray(train_run, slurm):
    code, job, log, run_dir, _ = train_run
    assert code == 0, log[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [s["step"] for s in steps] == list(range(1, TRAIN_STEPS + 1))  # each once
    assert all("timing_s/step" in s for s in steps)
    # the starting weights evaluated once (the requeued run resumes without it), and the last
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [0, TRAIN_STEPS]
    assert len(rows) == TRAIN_STEPS + 1
    assert re.search(r"ray cluster up: 1 node\(s\)", log) and "ray cluster stopped" in log
    assert not _ray_processes_of(job)


def test_train_job_signalled_before_its_time_limit_requeues_and_resumes(train_run):
    code, job, log, run_dir, after_signal_s = train_run
    assert code == 0, log[-4000:]
    assert "train.sbatch: USR1: forwarding to the training" in log
    stopped = re.search(r"stopped on SIGUSR1 after step (\d+); checkpoint (\S+);", log)
    assert stopped and "requeueing job" in log, log[-4000:]
    assert int(stopped[1]) < TRAIN_STEPS
    assert "run 1 (requeues so far)" in log, log[-4000:]
    assert f"resumed from {stopped[2]} (step {stopped[1]})" in log, log[-4000:]
    print(f"job {job}: stopped after step {stopped[1]}; both runs done {after_signal_s:.0f} s "
          "after USR1")


def test_failing_job_returns_its_exit_code(slurm, tmp_path):
    code, job, log = sbatch(slurm, "train.sbatch", "configs/tiny_ci.yaml", "steps=-1",
                            out=tmp_path / "fail.out", extra_env={"RUN_DIR": str(tmp_path)})
    assert code == 2, log[-4000:]  # the config error's exit code, through Ray and sbatch
    assert "config error: steps=-1" in log and "ray cluster stopped" in log
    assert not _ray_processes_of(job)


def test_bench_job_runs_one_rank_per_task(slurm, tmp_path):
    code, _, log = sbatch(slurm, "bench.sbatch", "model=micro", "actor.tp=1",
                          "rollout.tp=1", "check=true", out=tmp_path / "bench.out",
                          options=["--ntasks=2"], timeout=240)
    assert code == 0, log[-4000:]
    for rank in (0, 1):
        assert f"srun rank {rank}/2" in log, \
            "bench sync did not run one rank per srun task (mcore_rl/bench/sync.py must " \
            "launch through mcore_rl.launch.slurm.launch_ranks):\n" + log[-3000:]
    reports = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["check"] == "pass"
    assert set(reports[0]["bytes_received"]) == {"0", "1"}


def test_convert_job_converts_on_two_ranks(train_run, slurm, tmp_path):
    run_dir = train_run[3]
    dst = tmp_path / "mcore"
    code, _, log = sbatch(slurm, "convert.sbatch", "hf-to-mcore", run_dir / "model", dst,
                          out=tmp_path / "convert.out", timeout=240)
    assert code == 0, log[-4000:]
    report = json.loads([line for line in log.splitlines() if line.startswith("{")][-1])
    assert report["ranks"] == 2 and report["tensors"] > 0
    assert (dst / "metadata.json").is_file()

