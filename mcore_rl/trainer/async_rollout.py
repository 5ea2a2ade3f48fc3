"""Generation ahead of training with a staleness bound (`rollout.mode` one_step / async).

Versions: the engines hold weight version v = the number of RL updates synced into them; at
step n the actor trains on version n - 1 (the initial sync before step 1 is version 0, and a
run resumed after step s starts at version s). A batch generated on version v and trained at
step n has staleness (n - 1) - v; the bound is k = `rollout.max_staleness` (one_step: 1).

The schedule is deterministic — it depends on step numbers only, never on which thread wins
a race — so a run is reproducible and a resumed run equals the uninterrupted one:
- at the start of step n the engines hold version n - 1, and every batch m <= n + k not yet
  started is queued on it (at step 1: batches 1 .. 1 + k, all on version 0), so batch m is
  generated on version max(0, m - 1 - k) and its staleness is min(m - 1, k) <= k;
- one thread generates the queued batches in order, beside the actor's work;
- before a weight sync every queued batch is waited for (`quiesce`): weights never change
  under a running generation, so nothing is dropped by construction. A batch staler than k
  (a buffer saved by a run with a larger k and resumed with a smaller one) is dropped,
  counted in `staleness/dropped`, and regenerated on the current weights.

Because the batch of step n + k must be done before step n's sync, a larger k does not make a
step faster than k = 1 here; it bounds how far ahead the buffer may run. The checkpoint taken
after step n carries the finished batches n + 1 .. n + k with their versions.

An engine that dies under a batch ahead (trainer/recovery.py): the generating thread does not
restart it — the actor ranks may be training and a sync may be due. The error reaches the
main thread when it waits for that batch (`take`, `quiesce`, `state`); there every queued
batch is let finish (those on the dead engine fail at once), the controller's `recover`
restarts the engine, re-forms the sync group and syncs the actor's current weights, and
every batch lost is queued again on the version the engines then hold — fresher than the
one it was queued on, so the bound still holds. A run that recovered is no longer the
undisturbed run's twin (its lost batches were drawn on newer weights); a checkpoint never
saves a failed batch (a resumed run generates it again).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from mcore_rl.launch.watchdog import WatchdogTimeout
from mcore_rl.rollout.engine import RolloutError
from mcore_rl.trainer.metrics import PhaseTimer

GENERATION_THREAD = "mcore-rl-gen"


def on_generation_thread() -> bool:
    """Whether the caller runs on a pipeline's generating thread (where an engine failure is
    handed to the main thread rather than recovered in place)."""
    return threading.current_thread().name.startswith(GENERATION_THREAD)

# what `collect(step)` returns: (rollouts, generation timings, (start, end) wall clock)
Generated = tuple[Any, dict[str, float], tuple[float, float]]


@dataclass
class _Queued:
    future: concurrent.futures.Future
    version: int


class RolloutPipeline:
    """The batches generated ahead of the steps that train on them.

    collect(step, timer): generate and score the batch of `step` (called on the pipeline's
        thread; phases gen and reward on `timer`).
    max_staleness: k. last_step: no batch after it is generated.
    wait(future): the future's result under the caller's deadline (the watchdog's).
    recover(err): restart the engines an engine error broke and sync the actor's weights
        into them; returns the weight version the engines then hold (raises `err` when it
        was no engine failure). None: an engine failure ends the run."""

    def __init__(self, collect: Callable[[int], Any], *, max_staleness: int, last_step: int,
                 wait: Callable[[concurrent.futures.Future], Generated],
                 recover: Callable[[BaseException], int] | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.collect, self.k, self.last_step, self._wait = collect, max_staleness, last_step, wait
        self._recover = recover
        self.queued: dict[int, _Queued] = {}
        self.next_step = 1  # the first step whose batch has not been queued
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def _run(self, step: int) -> Generated:
        timer, start = PhaseTimer(), time.perf_counter()
        rollouts = self.collect(step, timer)
        timing = {k: v for k, v in timer.as_metrics().items() if k != "timing_s/step"}
        return rollouts, timing, (start, time.perf_counter())

    def _queue(self, step: int, version: int) -> None:
        if self._executor is None:  # one thread: generation runs beside the actor's work
            self._executor = concurrent.futures.ThreadPoolExecutor(1, GENERATION_THREAD)
        self.queued[step] = _Queued(self._executor.submit(self._run, step), version)

    def take(self, step: int, timer: PhaseTimer) -> tuple[Any, dict[str, float]]:
        """The batch step `step` trains on (the engines hold version step - 1), and its
        metrics: generation timings, `timing_s/gen_wait` (time blocked on it) and
        staleness/{mean,max,dropped}."""
        version = step - 1
        self.next_step = max(self.next_step, step)
        while self.next_step <= min(step + self.k, self.last_step):
            self._queue(self.next_step, version)
            self.next_step += 1
        dropped = 0
        queued = self.queued.get(step)
        if queued is not None and version - queued.version > self.k:
            with timer("gen_wait"):
                self._wait(queued.future)  # let the thread finish before regenerating
            dropped, queued = 1, None
        if queued is None:  # dropped, or its buffer was not saved: generate it now
            self._queue(step, version)
        with timer("gen_wait"):
            rollouts, timing, _ = self._result(step)
        queued = self.queued.pop(step)  # (queued again if an engine restart lost it)
        if getattr(rollouts, "step", step) != step:
            raise RuntimeError(f"batch of step {rollouts.step} offered to step {step}")
        staleness = float(version - queued.version)
        return rollouts, {**timing, "staleness/mean": staleness, "staleness/max": staleness,
                          "staleness/dropped": float(dropped)}

    def quiesce(self, timer: PhaseTimer | None = None,
                train_window: tuple[float, float] | None = None) -> dict[str, float]:
        """Wait for every queued batch (before the weights change). Returns how many seconds
        of generation ran while the step trained (`gen_overlap_s`; absent when nothing was
        queued)."""
        if not self.queued:
            return {}
        if timer is not None and not all(q.future.done() for q in self.queued.values()):
            with timer("gen_wait"):
                windows = [self._result(step)[2] for step in sorted(self.queued)]
        else:
            windows = [self._result(step)[2] for step in sorted(self.queued)]
        if train_window is None:
            return {}
        overlap = sum(max(min(end, train_window[1]) - max(start, train_window[0]), 0.0)
                      for start, end in windows)
        return {"gen_overlap_s": overlap}

    def _result(self, step: int) -> Generated:
        """The finished batch of queued `step`; one lost with an engine is generated again
        once the engines are restarted (module doc)."""
        while True:
            try:
                return self._wait(self.queued[step].future)
            except RolloutError as err:
                if self._recover is None:
                    raise
                self._regenerate_lost(err)

    def _regenerate_lost(self, err: RolloutError) -> None:
        """Let every queued batch finish (nothing may generate while engines restart),
        recover, and queue each batch an engine error lost again on the engines' version."""
        for queued in list(self.queued.values()):
            try:
                self._wait(queued.future)
            except WatchdogTimeout:
                raise
            except Exception:  # noqa: BLE001 — a lost batch, regenerated below
                pass
        version = self._recover(err)
        lost = [step for step, queued in sorted(self.queued.items())
                if isinstance(queued.future.exception(), RolloutError)]
        for step in lost:
            self._queue(step, version)
        print(f"mcore-rl: batch(es) of step(s) {lost} lost with the engine; generating them "
              f"again on weight version {version}", flush=True)

    # --- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict:
        """The finished batches ahead (plain values: `torch.load(weights_only=True)` reads
        them back). A batch lost with an engine is left out: a resumed run generates it."""
        batches = []
        for step, queued in sorted(self.queued.items()):
            try:
                rollouts, timing, _ = self._wait(queued.future)
            except RolloutError:
                continue
            batches.append({"step": step, "version": queued.version,
                            "rollouts": rollouts.to_state(), "timing": timing})
        return {"batches": batches, "next_step": self.next_step}

    def load_state(self, state: dict, from_state: Callable[[dict], Any]) -> None:
        """Restore `state()`'s batches (as finished generations); `from_state` rebuilds a
        batch from its saved form."""
        if "batches" not in state:
            raise ValueError("the checkpoint's rollout buffer holds partial generations (saved "
                             "with rollout.partial_chunk_tokens); resume with the same "
                             "rollout settings")
        self.queued = {}
        for saved in state["batches"]:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result((from_state(saved["rollouts"]), saved["timing"], (0.0, 0.0)))
            self.queued[int(saved["step"])] = _Queued(future, int(saved["version"]))
        self.next_step = int(state["next_step"])

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["GENERATION_THREAD", "RolloutPipeline", "on_generation_thread"]
