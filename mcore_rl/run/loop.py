"""The RL loop: every command that trains — `train`, `demo`, `bench step` — and the tests run
their RL steps through `run_steps`, so a step is recorded, checkpointed and stopped the same
way everywhere. What one step does is `RLController.rl_step` (mcore_rl/rl/controller.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from mcore_rl.rl import checkpoint_dirs
from mcore_rl.rl.recovery import EngineFailed
from mcore_rl.run.signals import RunStopped, StopControl
from mcore_rl.tasks.base import RewardFailed


def never(step: int) -> bool:
    return False


def run_steps(controller, steps: Iterable[int], record: Callable[[int, dict], None], *,
              checkpoint_due: Callable[[int], bool] = never, keep_last: int | None = None,
              stop: StopControl | None = None,
              evaluate_due: Callable[[int], bool] = never) -> Path | None:
    """RL steps `steps` in order; each one's metrics go to `record(step, metrics)`, also those
    of a step whose sync lost an engine for good (recorded, then EngineFailed is raised).
    After a step a checkpoint is written when `checkpoint_due(step)` or a stop was requested
    (older ones pruned to `keep_last`); a stop request then ends the run with RunStopped.
    When `evaluate_due(step)`, the step's record includes an evaluation on the weights it
    synced (`controller.evaluate`: eval/* metrics).
    A reward function that raised (RewardFailed, before the step changed any weight): the
    last step completed here is checkpointed unless it already is, the checkpoint set as the
    exception's `checkpoint`, and it is raised again. Returns the last checkpoint written
    (None: none was)."""
    saved = saved_step = done = None
    for step in steps:
        try:
            metrics = controller.rl_step(step)
        except EngineFailed as failed:  # checkpointed after this step: its metrics count too
            if failed.step_metrics is not None:
                record(step, failed.step_metrics)
            raise
        except RewardFailed as failed:
            if done is not None and saved_step != done:
                saved, saved_step = controller.save_checkpoint(done), done
                if keep_last is not None:
                    checkpoint_dirs.prune(saved.parent, keep_last)
            failed.checkpoint = saved  # None: no step completed here
            raise
        if evaluate_due(step):  # on the weights the step just synced: in the step's record
            metrics.update(controller.evaluate(step))
        record(step, metrics)
        done = step
        stopping = stop is not None and stop.requested
        if checkpoint_due(step) or stopping:
            saved, saved_step = controller.save_checkpoint(step), step
            if keep_last is not None:
                checkpoint_dirs.prune(saved.parent, keep_last)
        if stopping:
            print(f"checkpoint {saved} written {stop.seconds_since_signal():.1f} s after "
                  f"{stop.signal_name}")
            raise RunStopped(step, stop.signal_name, saved)
    return saved


__all__ = ["never", "run_steps"]
