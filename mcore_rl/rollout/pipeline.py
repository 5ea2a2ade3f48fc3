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

Free-running (`rollout.deterministic: false`): batches are queued as above, but before a weight
sync the trainer waits only for the generation running at that moment (`weights_changing`):
the pipeline is paused (no generation starts), the sync runs, and the queued batches that had
not started then generate on the new weights. Each batch records the version the engines held
when its generation started (read under the same lock the sync takes, so it is what happened,
not what was scheduled). The bound k still holds by construction: batch m is queued at a step
n >= m - k, when the engines hold version n - 1 >= m - 1 - k, and versions only grow; and it
cannot start on a version newer than m - 1 (the sync after step m needs batch m first), so its
staleness is in [0, k]. A batch staler than k (a resumed buffer) is still dropped and
regenerated. Which batches catch a newer version depends on how fast generation runs beside
training, so a run is not reproducible and a resume is not bit-exact (the checkpoint still
carries the finished batches with their versions).

An engine that dies under a batch ahead (rl/recovery.py): the generating thread does not
restart it — the actor ranks may be training and a sync may be due. The error reaches the
main thread when it waits for that batch (`take`, a deterministic `quiesce`); there the
pipeline is paused (no generation starts, the running one ends), the controller's `recover`
restarts the engine, re-forms the sync group and syncs the actor's current weights, and every
batch lost is queued again on the version the engines then hold — fresher than the one it was
queued on, so the bound still holds (a batch that had not started yet generates on that
version too and records it). A run that recovered is no longer the undisturbed run's twin;
a checkpoint never saves a failed batch, nor (when the pipeline is paused: a failure being
handled) one that has not run (a resumed run generates them).

A batch whose reward function raised (`tasks.base.RewardFailed`) is failed, not lost: waiting
for it before a sync does not raise (the step being trained is unharmed and its sync goes on),
and `take` raises it when its own step begins — before that step changes any weight, so the
checkpoint of the step before it holds the weights its batch was meant for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from mcore_rl.rollout.engine import RolloutError
from mcore_rl.launch.timing import PhaseTimer
from mcore_rl.tasks.base import RewardFailed

GENERATION_THREAD = "mcore-rl-gen"


def on_generation_thread() -> bool:
    """Whether the caller runs on a pipeline's generating thread (where an engine failure is
    handed to the main thread rather than recovered in place)."""
    return threading.current_thread().name.startswith(GENERATION_THREAD)


# what a batch's future holds: (rollouts, generation timings, (start, end) wall clock, the
# weight version it was generated on)
Generated = tuple[Any, dict[str, float], tuple[float, float], int]


@dataclass
class _Queued:
    future: concurrent.futures.Future


class RolloutPipeline:
    """The batches generated ahead of the steps that train on them.

    collect(step, timer): generate and score the batch of `step` (called on the pipeline's
        thread; phases gen and reward on `timer`).
    max_staleness: k. last_step: no batch after it is generated.
    wait(future): the future's result under the caller's deadline (the watchdog's).
    deterministic: the schedule of the module doc (True) or free-running (False).
    recover(err): restart the engines an engine error broke and sync the actor's weights
        into them; returns the weight version the engines then hold (raises `err` when it
        was no engine failure). None: an engine failure ends the run."""

    def __init__(self, collect: Callable[[int], Any], *, max_staleness: int, last_step: int,
                 wait: Callable[[concurrent.futures.Future], Any],
                 deterministic: bool = True,
                 recover: Callable[[BaseException], int] | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.collect, self.k, self.last_step, self._wait = collect, max_staleness, last_step, wait
        self.deterministic, self._recover = deterministic, recover
        self.queued: dict[int, _Queued] = {}
        self.next_step = 1  # the first step whose batch has not been queued
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # free-running: the engines' version, and the gate a sync closes (under _gate)
        self.version = 0
        self._gate = threading.Condition()
        self._paused = self._closed = False
        self._running: concurrent.futures.Future | None = None  # done when the call ends
        self._last_taken: int | None = None

    def _run(self, step: int, version: int) -> Generated:
        with self._gate:  # a generation never starts while the weights are changing
            while self._paused and not self._closed:
                self._gate.wait()
            if self._closed:
                raise concurrent.futures.CancelledError(f"batch {step}: pipeline shut down")
            # free-running: what the engines hold now, not what was scheduled; deterministic:
            # the same, unless an engine restart synced newer weights since it was queued
            version = max(version, self.version)
            running = self._running = concurrent.futures.Future()
        try:
            timer, start = PhaseTimer(), time.perf_counter()
            rollouts = self.collect(step, timer)
            timing = {k: v for k, v in timer.as_metrics().items() if k != "timing_s/step"}
            return rollouts, timing, (start, time.perf_counter()), version
        finally:
            with self._gate:
                self._running = None
            running.set_result(None)

    def _queue(self, step: int, version: int) -> None:
        if self._executor is None:  # one thread: generation runs beside the actor's work
            self._executor = concurrent.futures.ThreadPoolExecutor(1, GENERATION_THREAD)
        self.queued[step] = _Queued(self._executor.submit(self._run, step, version))

    def take(self, step: int, timer: PhaseTimer) -> tuple[Any, dict[str, float]]:
        """The batch step `step` trains on (the engines hold version step - 1), and its
        metrics: generation timings, `timing_s/gen_wait` (time blocked on it) and
        staleness/{mean,max,dropped}."""
        version = step - 1
        with self._gate:
            self.version, self._last_taken = version, step
        self.next_step = max(self.next_step, step)
        while self.next_step <= min(step + self.k, self.last_step):
            self._queue(self.next_step, version)
            self.next_step += 1
        dropped, generated = 0, None
        if step in self.queued:
            with timer("gen_wait"):
                generated = self._result(step)
            if version - generated[3] > self.k:  # staler than k: regenerate it now
                dropped, generated = 1, None
        if generated is None:  # dropped, or its buffer was not saved: generate it now
            self._queue(step, version)
            with timer("gen_wait"):
                generated = self._result(step)
        self.queued.pop(step)
        rollouts, timing, _, generated_on = generated
        if getattr(rollouts, "step", step) != step:
            raise RuntimeError(f"batch of step {rollouts.step} offered to step {step}")
        staleness = float(version - generated_on)
        return rollouts, {**timing, "staleness/mean": staleness, "staleness/max": staleness,
                          "staleness/dropped": float(dropped)}

    def quiesce(self, timer: PhaseTimer | None = None,
                train_window: tuple[float, float] | None = None) -> dict[str, float]:
        """Get ready for a weight change: wait for every queued batch (deterministic), or
        pause the pipeline and wait for the generation running now only (free-running; the
        sync's `weights_changing` resumes it). Returns how many seconds of generation ran
        while the step trained (`gen_overlap_s`; absent when nothing was queued)."""
        if not self.deterministic:
            self._pause(timer)
        if not self.queued:
            return {}
        finished = [step for step, q in sorted(self.queued.items())
                    if self.deterministic or q.future.done()]
        if timer is not None and not all(self.queued[s].future.done() for s in finished):
            with timer("gen_wait"):
                windows = [self._window(step) for step in finished]
        else:
            windows = [self._window(step) for step in finished]
        windows = [w for w in windows if w is not None]
        if train_window is None:
            return {}
        overlap = sum(max(min(end, train_window[1]) - max(start, train_window[0]), 0.0)
                      for start, end in windows)
        return {"gen_overlap_s": overlap}

    def _window(self, step: int) -> tuple[float, float] | None:
        """The (start, end) of queued `step`'s generation. Deterministic: waited for (a batch
        lost with an engine is generated again first); free-running (paused for a sync):
        None for a lost batch — `take` recovers it once the sync has resumed the pipeline."""
        if self.deterministic:
            try:
                return self._result(step)[2]
            except RewardFailed:  # raised by `take` of its step (module doc)
                return None
        future = self.queued[step].future
        return None if future.exception() is not None else future.result()[2]

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
        """Pause (nothing may generate while engines restart), recover, and queue each batch
        an engine error lost again on the version the engines then hold."""
        with self._gate:
            was_paused = self._paused
        self._pause(None)
        version = self._recover(err)
        lost = [step for step, queued in sorted(self.queued.items())
                if queued.future.done() and isinstance(queued.future.exception(), RolloutError)]
        with self._gate:
            self.version = max(self.version, version)
            self._paused = was_paused
            self._gate.notify_all()
        for step in lost:
            self._queue(step, version)
        print(f"mcore-rl: batch(es) of step(s) {lost} lost with the engine; generating them "
              f"again on weight version {version}", flush=True)

    def _pause(self, timer: PhaseTimer | None) -> None:
        """No generation starts from now on; returns once the running one (if any) is done,
        under the caller's deadline."""
        with self._gate:
            self._paused, running = True, self._running
        if running is not None:
            with timer("gen_wait") if timer is not None else contextlib.nullcontext():
                self._wait(running)

    @contextlib.contextmanager
    def weights_changing(self) -> Iterator[None]:
        """Around a weight sync: the weights never change under a running generation.
        Free-running, the queued batches then go on on the new version (the update of the
        step last taken); a sync that fails leaves the pipeline paused (its engines' weights
        are unknown) until shutdown."""
        if self.deterministic:
            self.quiesce()
            yield
            return
        self._pause(None)
        yield
        with self._gate:
            if self._last_taken is not None:  # else the first sync: take() sets the version
                self.version = self._last_taken
            self._paused = False
            self._gate.notify_all()

    # --- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict:
        """The finished batches ahead (plain values: `torch.load(weights_only=True)` reads
        them back). Left out (a resumed run generates them): a batch lost with an engine or
        whose reward raised, and while the pipeline is paused (an engine failure being
        handled) one not yet run."""
        batches = []
        with self._gate:
            paused = self._paused
        for step, queued in sorted(self.queued.items()):
            if paused and not queued.future.done():
                continue
            try:
                rollouts, timing, _, version = self._wait(queued.future)
            except (RolloutError, RewardFailed):
                continue
            batches.append({"step": step, "version": version,
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
            future.set_result((from_state(saved["rollouts"]), saved["timing"], (0.0, 0.0),
                               int(saved["version"])))
            self.queued[int(saved["step"])] = _Queued(future)
        self.next_step = int(state["next_step"])

    def shutdown(self) -> None:
        with self._gate:  # a generation waiting at the gate gives up
            self._closed = True
            self._gate.notify_all()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


__all__ = ["GENERATION_THREAD", "RolloutPipeline", "on_generation_thread"]
