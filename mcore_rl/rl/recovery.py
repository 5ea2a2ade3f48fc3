"""Rollout engines that die are restarted, and the run goes on (issue #16).

When an engine call fails — a generate call, or a weight sync — the controller hands the
error to `EngineRecovery.recover`, which, step by step:

1. finds the broken engines: every engine whose process is gone (`RayEngines.dead_engines`),
   and the engine the error names if it cannot generate one token (`RayEngines.probe`: its
   engine core or a TP worker process can die under a live engine actor). None broken: the
   error was not an engine failure (a bad prompt, a stuck engine — the watchdog's) and is
   raised as it was;
2. out of restarts (`max_engine_restarts` for the whole run), or partial rollouts → writes a
   checkpoint (once an RL step has begun; not with partial rollouts), then raises
   `EngineFailed` naming the engine(s) and carrying the original error's message;
3. waits the backoff and restarts the broken engines in their slots (fresh vLLM, loading the
   model directory: not yet the trainer's weights);
4. re-forms the sync group, which lost a member and so is broken for everyone: the actor
   ranks leave it, the surviving engines wait out their failed install and leave, and a new
   group (a new store on a bound socket, a new prefix) is joined by all;
5. syncs the actor's current weights into every engine;
6. returns: a failed generate call is then repeated as it was (same prompts, same seeds — the
   samples an undisturbed run draws, since the engines now hold the same weights); a failed
   sync needs nothing more (step 5 was it).
A failure during 3-5 goes back to 1 with the next, longer backoff.

The weights the actor holds — what a checkpoint in step 2 saves — are those after the last
update: step k - 1's while step k generates, step k's once it has trained (its sync).

one_step / async (`rollout/pipeline.py`): generation runs on the pipeline's thread
beside training. A batch ahead that an engine failure loses cannot be regenerated as it was
(it was drawn on weights the actor no longer holds): the pipeline hands the failure to the
main thread, which recovers as above (steps 1-5) once no generation runs, and generates every
lost batch again on the weights the engines then hold (`actor_version`). A failed sync is
recovered as in sync mode. Partial rollouts (`rollout.partial_chunk_tokens`) are not
restarted — their generations in flight live in the dead engine: the run stops with
`EngineFailed`, and re-running the same command resumes from the last checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from mcore_rl.rl import checkpoint_dirs
from mcore_rl.rl.checkpoint_dirs import CheckpointWriteError
from mcore_rl.runconfig.sections import RecoveryConfig


class EngineFailed(RuntimeError):
    """A rollout engine died and was not restarted (out of restarts, or a rollout mode that
    does not restart). `engines`: their indices; `checkpoint`: the checkpoint written before
    the error (None when none was); `step_metrics`: the metrics of the step that had trained
    when its sync failed (the run loop writes them, so a resumed run misses no step)."""

    def __init__(self, message: str, engines: list[int], checkpoint=None):
        super().__init__(message)
        self.engines, self.checkpoint = engines, checkpoint
        self.step_metrics: dict[str, float] | None = None


def kill_process_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and every process under it (vLLM's engine-core / TP worker processes);
    returns the pids signalled once they are gone."""
    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for proc in victims:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10.0)
    return [proc.pid for proc in victims]


class InjectedKills:
    """recovery.inject_kill (tests): SIGKILLs engine 0's processes at the configured
    (phase, step) points. The controller tells it the step; the generate call and the weight
    sync call `inject` where a kill lands."""

    def __init__(self, cfg: RecoveryConfig, engines):
        self.engines, self.step = engines, None
        self._due = cfg.injected_kills()

    def begin_step(self, step: int) -> None:
        self.step = step

    def inject(self, phase: str) -> None:
        """SIGKILL engine 0's processes if (phase, this step) is due — for gen on a thread,
        so that it lands as the generate call goes out."""
        if (phase, self.step) not in self._due:
            return
        self._due.discard((phase, self.step))
        pid, step = self.engines.pids[0], self.step

        def kill() -> None:
            killed = kill_process_tree(pid)
            print(f"mcore-rl: inject_kill: SIGKILL rollout engine 0 (pids {killed}) during "
                  f"{phase} of step {step}", flush=True)

        if phase == "gen":
            threading.Thread(target=kill, name="mcore-rl-inject-kill", daemon=True).start()
        else:
            kill()


class EngineRecovery:
    """The controller's engine-failure handling (module doc). `engines`: the rollout
    engines; `weight_sync`: re-forms the sync group and re-syncs (rl/weight_sync.py);
    `save_checkpoint(step)`: writes the run's checkpoint before giving up; `restartable`:
    False with partial rollouts (the generations in flight die with the engine)."""

    def __init__(self, cfg: RecoveryConfig, *, engines, weight_sync,
                 save_checkpoint: Callable[[int], Path], checkpoint_root: Path,
                 keep_last: int, restartable: bool = True):
        self.cfg, self.engines, self.weight_sync = cfg, engines, weight_sync
        self.save_checkpoint, self.checkpoint_root = save_checkpoint, checkpoint_root
        self.keep_last, self.restartable = keep_last, restartable
        self.restarts_used = 0
        self.step: int | None = None  # the RL step in progress (None before the first)
        self.trained = False  # whether that step's update has happened
        self._since_report = {"restarts": 0, "seconds": 0.0}

    # --- what the controller tells it -------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.step, self.trained = step, False

    def step_trained(self) -> None:
        self.trained = True

    def actor_version(self) -> int:
        """The weight version the actor holds (= RL updates made): what a recovery syncs."""
        if self.step is None:
            return 0
        return self.step if self.trained else self.step - 1

    def metrics(self) -> dict[str, float]:
        """Per step: `recovery/engine_restarts` — engines restarted since the last report (in
        this step, or before step 1 for the first); `recovery/seconds` — time spent
        recovering (backoff, restart, re-forming the group, re-sync), inside the gen or sync
        phase it interrupted."""
        out = {"recovery/engine_restarts": float(self._since_report["restarts"]),
               "recovery/seconds": self._since_report["seconds"]}
        self._since_report = {"restarts": 0, "seconds": 0.0}
        return out

    # --- recovery -----------------------------------------------------------------------------

    def recover(self, err: Exception, phase: str, named: int | None = None) -> dict[str, float]:
        """Restart the engines `err` broke, re-form the sync group and re-sync the actor's
        weights (module doc); returns that sync's metrics. Raises `err` when no engine is
        broken, EngineFailed when they cannot be restarted. `named`: the engine the error
        names, if any."""
        start, attempt = time.perf_counter(), 0
        try:
            while True:
                broken = self._broken(named)
                if not broken:
                    raise err
                self._give_up_unless_allowed(broken, err, phase)
                wait = self.cfg.backoff(attempt)
                print(f"mcore-rl: rollout engine(s) {broken} failed during {phase}"
                      f"{self._where()} ({err}); restarting in {wait:.1f} s "
                      f"(restart {self.restarts_used + 1} of "
                      f"{self.cfg.max_engine_restarts})", flush=True)
                time.sleep(wait)
                self.restarts_used += len(broken)
                self._since_report["restarts"] += len(broken)
                try:
                    return self._restart_and_resync(broken)
                except Exception as again:  # noqa: BLE001 — decided by the next round's check
                    err, named, phase, attempt = again, getattr(again, "engine", None), \
                        "restart", attempt + 1
        finally:
            self._since_report["seconds"] += time.perf_counter() - start

    def _broken(self, named: int | None) -> list[int]:
        broken = set(self.engines.dead_engines())
        if named is not None and named not in broken and self.engines.probe(named) is not None:
            broken.add(named)
        return sorted(broken)

    def _where(self) -> str:
        return "" if self.step is None else f" of step {self.step}"

    def _give_up_unless_allowed(self, broken: list[int], err: Exception, phase: str) -> None:
        if not self.restartable:
            raise EngineFailed(
                f"rollout engine(s) {broken} died during {phase}{self._where()}: {err}; engines "
                "are not restarted with partial rollouts (rollout.partial_chunk_tokens: the "
                "generations in flight lived in the engine); the run stops — re-run the same "
                "command to resume from the last complete checkpoint", broken)
        if self.restarts_used + len(broken) <= self.cfg.max_engine_restarts:
            return
        checkpoint, note = None, "no checkpoint (no RL step has begun)"
        if self.step is not None:
            weights_step = self.step if self.trained else self.step - 1
            try:
                checkpoint = self._checkpoint(weights_step)
                note = f"checkpoint {checkpoint} written (the actor after step {weights_step})"
            except CheckpointWriteError as save_err:
                note = f"no checkpoint: {save_err}"
        raise EngineFailed(
            f"rollout engine(s) {broken} died during {phase}{self._where()}: {err}; out of "
            f"restarts (recovery.max_engine_restarts={self.cfg.max_engine_restarts}, "
            f"{self.restarts_used} used); {note}", broken, checkpoint)

    def _checkpoint(self, step: int) -> Path:
        """The checkpoint of the actor after `step` (an existing complete one is kept)."""
        existing = self.checkpoint_root / f"step_{step}"
        if checkpoint_dirs.is_complete(existing):
            return existing
        saved = self.save_checkpoint(step)
        checkpoint_dirs.prune(saved.parent, self.keep_last)
        return saved

    def _restart_and_resync(self, broken: list[int]) -> dict[str, float]:
        restarted = time.perf_counter()
        self.engines.restart(broken)
        self.weight_sync.rejoin_after_restart(
            [i for i in range(self.engines.num_engines) if i not in broken])
        sync = self.weight_sync.sync_once()
        print(f"mcore-rl: rollout engine(s) {broken} restarted (new pids "
              f"{[self.engines.pids[i] for i in broken]}), sync group re-formed and "
              f"weights re-synced in {time.perf_counter() - restarted:.1f} s", flush=True)
        return sync


__all__ = ["EngineFailed", "EngineRecovery", "InjectedKills", "kill_process_tree"]
