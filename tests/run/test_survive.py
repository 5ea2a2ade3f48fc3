"""Runs that survive, with real `mcore-rl train` processes and real signals.

One uninterrupted run is the reference (and, while it runs, every listening socket of its
whole process tree — driver, Ray, actor ranks, vLLM — is checked to be on loopback). A second
run of the same command gets SIGTERM (to its whole process group, as SLURM would send it) at a
random early step: it finishes that step, checkpoints and exits 75; the same command again
resumes by itself and gets SIGINT (to its process group, as a terminal's Ctrl-C): it too
finishes the step, checkpoints and exits 130, in one line, no traceback; the same command
once more resumes and ends with the reference's metrics (every step once, each with a
gradient) and final actor weights, bit for bit. The finished run re-run reports "already
complete" at once; its final checkpoint exported (`mcore-rl export`) gives the actor's logits
in HF transformers.
In-process: a full disk at save time and a dead actor rank are named.
The rollout engine's processes are SIGKILLed as step 2's generation goes out and while step
3's weight sync is in flight: the run restarts the engine both times; a third kill, past the
allowed restarts, writes a checkpoint and ends the run naming the engine (exit 3); the steps
before it equal the reference's bit for bit.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from mcore_rl.launch.listen import is_loopback
from mcore_rl.rl import checkpoint_dirs
from mcore_rl.launch.exit_codes import INTERRUPT_EXIT_CODE, STOP_EXIT_CODE

from tests.support.rl_runs import DETERMINISTIC
from tests.support import DEMO_SIZED

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
# lr 0.01: large steps, so a resume that lost state (weights, Adam moments, schedule) would
# show; spread_reward: no group of an untrained model's samples ties in reward, so every step
# has a gradient and really trains
OVERRIDES = ["warmup.max_steps=0", f"steps={STEPS}", "prompts_per_step=4",
             "samples_per_prompt=4", "updates_per_batch=2", "train.micro_batch_size=4",
             "actor.tp=2", "train.optimizer.lr=0.01",
             "task.reward_fn=tests.support.rewards:spread_reward",
             "checkpoint.every=2", "checkpoint.keep_last=1"]

# end-to-end CLI runs that load every core: run apart from the other such file on the
# parallel workers (tests/support/scheduling.py's WHOLE_MACHINE)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _train(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mcore_rl.cli", "train", "--config", "configs/tiny_ci.yaml",
           "--out", str(out), *OVERRIDES, *extra]
    log = open(out.parent / f"{out.name}.log", "a")
    # its own session: signalling the group reaches the driver and every process it started
    # in its group, as a shell's Ctrl-C or a batch system would
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, out: Path, timeout: float = 400) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return code, (out.parent / f"{out.name}.log").read_text()


def _steps_logged(out: Path) -> list[int]:
    """The RL steps in metrics.jsonl (not the row of step 0: an evaluation before training)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()
             if line.endswith("}")]
    return [step for step in steps if step > 0]


def _metrics(out: Path) -> dict[int, dict]:
    """metrics.jsonl's rows by RL step (not step 0's: an evaluation before training)."""
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").open())
            if row["step"] > 0}


def _wait_for_step(proc, out: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(_steps_logged(out)) < step:
        assert proc.poll() is None, f"run ended (code {proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.2)


def _listeners(pid: int) -> dict[str, set[str]]:
    """Every listening TCP socket of the process tree under `pid`: address -> processes."""
    found: dict[str, set[str]] = {}
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="inet")
            name = f"{proc.pid}:{proc.name()}"
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for conn in conns:
            if conn.status == psutil.CONN_LISTEN:
                found.setdefault(f"{conn.laddr.ip}:{conn.laddr.port}", set()).add(name)
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run; its listening sockets sampled after its first step."""
    out = tmp_path_factory.mktemp("survive") / "full"
    proc = _train(out)
    try:
        _wait_for_step(proc, out, 1)
        listeners = _listeners(proc.pid)
    finally:
        code, log = _finish(proc, out)
    assert code == 0, log[-4000:]
    return out, listeners


def test_nothing_listens_beyond_loopback(reference):
    _, listeners = reference
    assert listeners, "found no listening socket at all: the probe is broken"
    beyond = {addr: procs for addr, procs in listeners.items()
              if not is_loopback(addr.rsplit(":", 1)[0])}
    assert not beyond, f"listening beyond loopback: {beyond}"


def test_the_summary_accounts_for_the_start_up_cpu_of_every_process(reference):
    out, _ = reference
    summary = json.loads((out / "summary.json").read_text())
    cpu = summary["startup_cpu_s"]
    # two actor ranks and one engine, each importing torch and its library: seconds each
    assert cpu["actor ranks"] > 1.0 and cpu["engines"] > 1.0 and cpu["driver"] > 1.0, cpu
    assert cpu["total"] == pytest.approx(sum(v for k, v in cpu.items() if k != "total"),
                                         abs=0.05)
    # wall time since process start cannot beat the CPU work spread over the cores
    assert summary["startup_cpu_floor_s"] <= summary["startup_s"] + 0.5, summary
    print(f"start-up {summary['startup_s']:.1f} s, CPU {cpu}")


def _stop(proc, out: Path, sig: signal.Signals, after: int) -> tuple[int, Path, str]:
    """Signal the run's process group once step `after` is logged (the signal lands during
    step after+1); the run must stop at a safe point with a checkpoint. Returns (the step it
    stopped after, its checkpoint, the log of this run)."""
    log_file = out.parent / f"{out.name}.log"
    logged_before = len(log_file.read_text()) if log_file.is_file() else 0
    _wait_for_step(proc, out, after)
    os.killpg(proc.pid, sig)
    signalled = time.monotonic()
    code, log = _finish(proc, out)
    log = log[logged_before:]
    stop_s = time.monotonic() - signalled
    assert code == (INTERRUPT_EXIT_CODE if sig == signal.SIGINT else STOP_EXIT_CODE), \
        log[-4000:]
    stopped_at = _steps_logged(out)[-1]
    assert stopped_at in (after, after + 1), (after, _steps_logged(out))
    saved = checkpoint_dirs.newest_complete(out / "checkpoints")
    assert saved.name == f"step_{stopped_at}", log[-2000:]
    assert (saved / "actor").is_dir() and not list(saved.parent.glob(".step_*")), \
        list(saved.parent.iterdir())  # the actor's shards in it; no save left half-written
    assert f"{sig.name} received" in log and "Traceback" not in log, log[-4000:]
    assert log.strip().splitlines()[-1] == (
        f"mcore-rl train: stopped on {sig.name} after step {stopped_at}; checkpoint {saved}; "
        f"exit code {code} (re-run the same command to resume)"), log[-2000:]
    print(f"stopped {stop_s:.1f} s after {sig.name} at step {stopped_at}")
    return stopped_at, saved, log


def test_sigterm_and_ctrl_c_checkpoint_and_the_same_command_resumes_exactly(reference,
                                                                            tmp_path):
    """SIGTERM lands in step 2 or 3 (exit 75); the resumed run gets SIGINT, as a terminal's
    Ctrl-C sends it to the foreground process group, a step later (exit 130: Ray's
    processes in the group do not die of it, the checkpoint is written); the third run
    resumes and completes, equal to the reference: every step's metrics and the final
    weights, bit for bit. Every step trained (a non-zero gradient), the resumed ones too, so
    equal weights mean each resume restored the weights, the optimizer's state and the
    schedule (fp32, seeded sampling, deterministic CPU)."""
    full, _ = reference
    out = tmp_path / "run"
    after = random.Random().randint(1, 2)  # the SIGTERM lands during step after+1
    print(f"SIGTERM after step {after} is logged")
    stopped_at, saved, _ = _stop(_train(out), out, signal.SIGTERM, after)

    proc = _train(out)
    stopped_at, saved, log = _stop(proc, out, signal.SIGINT, stopped_at + 1)
    assert stopped_at < STEPS  # a step is left for the resumed run
    assert "Ctrl-C again exits at once without one" in log

    code, log = _finish(_train(out), out)
    assert code == 0, log[-4000:]
    assert f"resumed from {saved} (step {stopped_at})" in log
    assert _steps_logged(out) == list(range(1, STEPS + 1))  # none missing, none repeated
    want, got = _metrics(full), _metrics(out)
    for step in range(1, STEPS + 1):
        for key in DETERMINISTIC:
            assert got[step][key] == want[step][key], (step, key)
    digests = json.loads((out / "summary.json").read_text())["weights_digests"]
    assert digests == json.loads((full / "summary.json").read_text())["weights_digests"]
    # every step trained, the ones after each resume included
    assert all(got[step]["grad_norm"] > 0 for step in range(1, STEPS + 1)), \
        [got[step]["grad_norm"] for step in range(1, STEPS + 1)]
    # keep_last=1: only the final checkpoint remains, complete
    assert [p.name for p in (out / "checkpoints").iterdir() if p.is_dir()] == [f"step_{STEPS}"]

    started = time.monotonic()
    code, log = _finish(_train(out), out, timeout=120)
    assert code == 0 and "run already complete" in log, log[-2000:]
    assert time.monotonic() - started < 60  # no Ray, no workers


def test_the_finished_run_exports_the_actors_weights_as_an_hf_model(reference, tmp_path):
    """`mcore-rl export RUN_DIR OUT` on the finished run: its final checkpoint (written after
    the last step whatever checkpoint.every says) as an HF directory whose transformers
    logits equal the actor's (the checkpoint's weights in Megatron at the run's TP2)."""
    from safetensors.torch import load_file

    from mcore_rl.cli import main
    from mcore_rl.conversion.verify import verify_conversion
    from mcore_rl.models.spec import ModelSpec
    from mcore_rl.parallel import ParallelConfig

    full, _ = reference
    assert main(["export", str(full), str(tmp_path / "hf"), "--no-progress"]) == 0
    final = full / "checkpoints" / f"step_{STEPS}" / "actor"
    spec = ModelSpec.from_hf_dir(tmp_path / "hf")
    assert spec == ModelSpec.from_hf_dir(full / "model")  # the run's model, its tokenizer too
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()
    report = verify_conversion(tmp_path / "hf", final, spec, ParallelConfig(tp=2),
                               prompts=4, seq_len=12)
    print(report.summary())
    assert report.max_abs_diff < 1e-4 and report.max_abs_logit > 0.1, report
    trained, start = (load_file(p / "model.safetensors") for p in (tmp_path / "hf",
                                                                    full / "model"))
    assert trained.keys() == start.keys()
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the trained weights


def test_a_full_disk_and_a_dead_actor_rank_are_named(ray_cluster, tmp_path):
    """One controller, in the session's Ray (tests/support/ray_cluster.py): a save that finds
    the disk full (injected after the ranks wrote their shards) fails naming the path and
    leaves the previous checkpoint complete and loadable; then SIGKILL of actor rank 1: the
    next step fails at once (not after its TP peer's collective timeout) with an error naming
    the rank, its pid and the phase."""
    from mcore_rl.config import load_config
    from mcore_rl.launch.watchdog import WorkerDied
    from mcore_rl.rl.checkpoint_dirs import CheckpointWriteError
    from mcore_rl.run.lifecycle import RLRun, build_demo_model
    from mcore_rl.runconfig import RLConfig

    cfg = load_config(RLConfig, DEMO_SIZED, [*OVERRIDES, "deadlines.train_s=120",
                                       "checkpoint.inject_error=save@step2"])
    root = tmp_path / "checkpoints"
    with RLRun(cfg, tmp_path, model_dir=build_demo_model(cfg, tmp_path / "model")) as run:
        controller = run.controller
        run.begin()
        controller.rl_step(1)
        first = controller.save_checkpoint(1)
        controller.rl_step(2)
        with pytest.raises(CheckpointWriteError) as full_disk:
            controller.save_checkpoint(2)
        assert controller.load_checkpoint(root) == 1  # the previous one, still loadable
        pid = controller.actors.pids[1]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDied) as died:
            controller.rl_step(2)
        elapsed = time.monotonic() - start
    message = str(full_disk.value)
    assert len(message.splitlines()) == 1 and "\x1b[" not in message, message  # no traceback
    assert f"checkpoint after step 2 not written: {root / '.step_2.tmp'}" in message
    assert "No space left on device" in message and f"{root} is intact" in message
    assert checkpoint_dirs.newest_complete(root) == first
    assert not list(root.glob(".step_*")) and not (root / "step_2").exists()
    assert f"actor rank 1 (pid {pid}) died during phase 'old_logprob'" in str(died.value)
    assert elapsed < 60, elapsed  # not the 120 s collective deadline



def test_engine_killed_in_generation_and_in_a_sync_is_restarted_then_out_of_restarts(
        reference, tmp_path):
    """inject_kill SIGKILLs engine 0's process tree (the EngineHost actor's pid from Ray, and
    any vLLM process under it) as step 2's generate call goes out, while step 3's sync is in
    flight (the engine receiving, the trainer about to send), and again in step 4's sync.
    The first two times the controller restarts the engine, re-forms the sync group,
    re-syncs the actor's weights and repeats what was lost (the generate call with its seeds,
    or the sync): steps 1-4 equal the reference's bit for bit (the regenerated batch is the
    one an undisturbed run draws). The third kill finds max_engine_restarts=2 used up: a
    complete checkpoint of step 4 is written, step 4's metrics are logged, and the run exits
    3 naming the engine. (Resuming from a checkpoint is test_sigterm_...'s.)"""
    full, _ = reference
    out = tmp_path / "run"
    started = time.monotonic()
    code, log = _finish(_train(out, "recovery.inject_kill=gen@2,sync@3,sync@4",
                               "recovery.max_engine_restarts=2",
                               "recovery.restart_backoff_s=0.1"), out)
    first_s = time.monotonic() - started
    assert code == 3, log[-4000:]
    assert log.count("inject_kill: SIGKILL rollout engine 0 (pids [") == 3, log[-4000:]
    assert "failed during generate of step 2" in log and "failed during sync of step 3" in log
    assert log.count("restarted (new pids") == 2, log[-4000:]
    assert "rollout engine(s) [0] died during sync of step 4" in log, log[-4000:]
    assert "out of restarts (recovery.max_engine_restarts=2, 2 used)" in log
    saved = checkpoint_dirs.newest_complete(out / "checkpoints")
    assert saved is not None and saved.name == "step_4", log[-4000:]
    assert f"checkpoint {saved} written (the actor after step 4)" in log
    assert _steps_logged(out) == [1, 2, 3, 4]
    want, got = _metrics(full), _metrics(out)
    restarts = [got[step]["recovery/engine_restarts"] for step in range(1, 5)]
    assert restarts == [0, 1, 1, 0], restarts  # per step (step 4's kill was not restarted)
    for step in range(1, 5):
        for key in DETERMINISTIC:
            assert got[step][key] == want[step][key], (step, key)
    recovery_s = [round(got[s]["recovery/seconds"], 1) for s in (2, 3)]
    print(f"engine restarts: recovery {recovery_s} s (steps 2, 3); run {first_s:.1f} s")


def test_async_run_restarts_an_engine_killed_under_a_batch_ahead_and_in_a_sync(tmp_path):
    """rollout.mode=async (k = 2): engine 0 is SIGKILLed as a batch ahead goes out during
    step 2 (generation runs on the pipeline's thread beside training) and while step 3's sync
    is in flight. The lost batch surfaces when the main thread waits for the batches ahead;
    the engine is restarted, the actor's weights synced, and the batch generated again on
    them; the failed sync is recovered as in sync mode. The run completes every step, the
    restarts in its metrics, no batch staler than k."""
    out, steps = tmp_path / "async", 4  # step 2 queues batch 4: a generation during step 2
    code, log = _finish(_train(out, f"steps={steps}", "rollout.mode=async",
                               "rollout.max_staleness=2",
                               "recovery.inject_kill=gen@2,sync@3",
                               "recovery.restart_backoff_s=0.1"), out)
    assert code == 0, log[-4000:]
    assert log.count("inject_kill: SIGKILL rollout engine 0 (pids [") == 2, log[-4000:]
    assert log.count("restarted (new pids") == 2, log[-4000:]
    assert "failed during generate of step 2" in log and "failed during sync of step 3" in log
    assert "lost with the engine; generating them again on weight version 2" in log
    assert _steps_logged(out) == list(range(1, steps + 1))
    got = _metrics(out)
    assert sum(got[s]["recovery/engine_restarts"] for s in got) == 2
    assert all(got[s]["staleness/max"] <= 2 for s in got), got
