"""The rollout pipeline's schedule (rollout.mode one_step / async), without engines: a fake
generator records which weight version the "engines" held while it generated each batch; the
loop syncs (version + 1) after each step as the controller does."""

import concurrent.futures
import threading
import time
import warnings

import pytest
import torch

from mcore_rl.config import ConfigError, load_config
from mcore_rl.rollout.engine import RolloutError
from mcore_rl.rollout.pipeline import RolloutPipeline
from mcore_rl.launch.timing import PhaseTimer
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


class FakeBatch:
    def __init__(self, step, version):
        self.step, self.version = step, version

    def to_state(self):
        return {"step": self.step, "version": self.version}

    @classmethod
    def from_state(cls, state):
        return cls(state["step"], state["version"])


class FakeRun:
    """Engines at `version`; generation takes a little wall time and must see one version."""

    def __init__(self):
        self.version, self.generated = 0, []

    def collect(self, step, timer):
        start = self.version
        with timer("gen"):
            time.sleep(0.002)
        assert self.version == start, "weights changed under a running generation"
        self.generated.append(step)
        return FakeBatch(step, start)


def pipeline(run, k, last=7):
    return RolloutPipeline(run.collect, max_staleness=k, last_step=last,
                           wait=lambda f: f.result(timeout=30))


def run_steps(p, run, steps):
    out = {}
    for step in steps:
        batch, metrics = p.take(step, PhaseTimer())
        assert batch.step == step
        out[step] = (batch.version, metrics["staleness/max"], metrics["staleness/dropped"])
        p.quiesce(PhaseTimer(), (0.0, 1.0))
        run.version += 1  # the weight sync after step's update
    return out


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_staleness_is_bounded_by_k_and_exactly_min_step_k(k):
    run = FakeRun()
    p = pipeline(run, k)
    out = run_steps(p, run, range(1, 8))
    for step, (version, staleness, dropped) in out.items():
        # trained at version step - 1, generated on max(0, step - 1 - k)
        assert version == max(0, step - 1 - k) and staleness == min(step - 1, k) <= k
        assert dropped == 0
    assert run.generated == list(range(1, 8))  # each batch once, in order, none past last
    p.shutdown()


def test_resume_from_saved_buffer_equals_uninterrupted(tmp_path):
    full_run = FakeRun()
    full = run_steps(pipeline(full_run, 2), full_run, range(1, 8))

    run = FakeRun()
    first = pipeline(run, 2)
    run_steps(first, run, range(1, 4))
    torch.save(first.state(), tmp_path / "rollout_buffer.pt")  # checkpoint after step 3
    first.shutdown()
    resumed_run = FakeRun()
    resumed_run.version = 3
    resumed = pipeline(resumed_run, 2)
    resumed.load_state(torch.load(tmp_path / "rollout_buffer.pt", weights_only=True),
                       FakeBatch.from_state)
    out = run_steps(resumed, resumed_run, range(4, 8))
    assert out == {s: full[s] for s in range(4, 8)}
    assert resumed_run.generated == [6, 7]  # 4 and 5 came from the checkpoint


def test_batches_staler_than_k_are_dropped_and_regenerated():
    run = FakeRun()
    wide = pipeline(run, 3)
    run_steps(wide, run, range(1, 3))  # queued: 3, 4 on version 0; 5 on version 1
    narrow = pipeline(run, 1)  # resumed with a smaller bound
    narrow.load_state(wide.state(), FakeBatch.from_state)
    out = run_steps(narrow, run, range(3, 6))
    # each saved batch is more than 1 update old when its step comes: dropped, counted,
    # regenerated on the weights of that step
    assert out == {3: (2, 0.0, 1.0), 4: (3, 0.0, 1.0), 5: (4, 0.0, 1.0)}


class DyingEngineRun(FakeRun):
    """The engine dies as the batches of `lost` go out (each once); `recover` restarts it and
    syncs the actor's weights, as the controller does: the engines then hold the actor's
    version (`actor`: the updates made so far)."""

    def __init__(self, lost):
        super().__init__()
        self.lost, self.actor, self.recoveries = set(lost), 0, []

    def collect(self, step, timer):
        if step in self.lost:
            self.lost.discard(step)
            raise RolloutError(0, "generate", "engine actor died")
        return super().collect(step, timer)

    def recover(self, err):
        self.recoveries.append(str(err))
        self.version = self.actor
        return self.version


def test_batches_lost_with_an_engine_are_generated_again_on_the_restarted_engine():
    run = DyingEngineRun(lost={3, 4})
    p = RolloutPipeline(run.collect, max_staleness=2, last_step=7,
                        wait=lambda f: f.result(timeout=30), recover=run.recover)
    out = {}
    for step in range(1, 8):
        batch, metrics = p.take(step, PhaseTimer())
        assert batch.step == step
        out[step] = (batch.version, metrics["staleness/max"])
        run.actor += 1  # the update
        p.quiesce(PhaseTimer(), (0.0, 1.0))
        run.version = run.actor  # the sync
    # batch 3 (queued at step 1 on version 0) and batch 4 (at step 2 on version 1) were lost;
    # each failure surfaced in that step's wait for its batches ahead, after the update, so
    # the recovery synced the actor's newer weights and the batch was generated again on
    # them — fresher than queued, inside the bound
    assert len(run.recoveries) == 2 and "engine actor died" in run.recoveries[0]
    assert out == {1: (0, 0.0), 2: (0, 1.0), 3: (1, 1.0), 4: (2, 1.0), 5: (2, 2.0),
                   6: (3, 2.0), 7: (4, 2.0)}
    assert sorted(run.generated) == list(range(1, 8))
    p.shutdown()


def test_an_engine_failure_without_recovery_ends_the_run_and_a_checkpoint_skips_lost_batches():
    run = DyingEngineRun(lost={2})
    p = pipeline(run, 2)
    with pytest.raises(RolloutError, match="engine actor died"):
        p.take(1, PhaseTimer()) and p.quiesce(PhaseTimer(), (0.0, 1.0))
    state = p.state()  # batch 2 was lost: not saved, a resumed run generates it
    assert [b["step"] for b in state["batches"]] == [3]
    p.shutdown()


@pytest.mark.parametrize("overrides,field,problem", [
    (["rollout.max_staleness=-1"], "rollout.max_staleness", "must be >= 0"),
    (["rollout.mode=offline"], "rollout.mode", "allowed values: sync, one_step, async"),
    (["rollout.mode=async", "rollout.enable_sleep=true"], "rollout.mode", "cannot sleep"),
    (["off_policy_steps=2"], "off_policy_steps", "must be 0 or 1"),
    (["off_policy_steps=1", "rollout.mode=async"], "off_policy_steps", "contradicts"),
])
def test_bad_rollout_mode_names_the_field(overrides, field, problem):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, DEMO_SIZED, overrides)
    assert err.value.field == field and problem in str(err.value)


def test_off_policy_steps_is_a_deprecated_alias():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(RLConfig, DEMO_SIZED, ["off_policy_steps=1"])
    assert cfg.rollout.mode == "one_step" and cfg.rollout.staleness_bound == 1
    assert any("rollout.mode=one_step" in str(w.message) for w in caught)
    assert load_config(RLConfig, DEMO_SIZED, ["rollout.mode=async", "rollout.max_staleness=3"]
                       ).rollout.staleness_bound == 3


# --- free-running (rollout.deterministic: false) ------------------------------------------------

class GatedRun:
    """Fake engines whose generation of batch m starts (`started[m]`), then blocks until the
    test lets it finish (`release[m]`); the weights must not change while it runs."""

    def __init__(self, last):
        self.version, self.started_on = 0, {}
        self.started = {m: threading.Event() for m in range(1, last + 1)}
        self.release = {m: threading.Event() for m in range(1, last + 1)}

    def collect(self, step, timer):
        start = self.started_on[step] = self.version
        self.started[step].set()
        assert self.release[step].wait(timeout=30), f"batch {step} never released"
        assert self.version == start, "weights changed under a running generation"
        return FakeBatch(step, start)


def sync_in_thread(p, run):
    """The controller's end of a step (quiesce, then the weight sync: version + 1) on another
    thread; returns it started."""
    def sync():
        p.quiesce(PhaseTimer(), (0.0, 1.0))
        with p.weights_changing():
            run.version += 1
    thread = threading.Thread(target=sync, daemon=True)
    thread.start()
    return thread


def first_sync_with_batch_2_running(deterministic):
    """Step 1 trains while batch 2 runs and batch 3 waits in the queue; then the sync."""
    run = GatedRun(last=6)
    p = RolloutPipeline(run.collect, max_staleness=2, last_step=6,
                        wait=lambda f: f.result(timeout=30), deterministic=deterministic)
    run.release[1].set()
    batch, metrics = p.take(1, PhaseTimer())  # queues batches 1, 2, 3 on version 0
    assert (batch.version, metrics["staleness/max"]) == (0, 0)
    assert run.started[2].wait(timeout=30)
    return run, p


def test_free_running_sync_waits_for_the_running_batch_only():
    run, p = first_sync_with_batch_2_running(deterministic=False)
    thread = sync_in_thread(p, run)  # pauses the pipeline, waits for batch 2 ...
    thread.join(timeout=0.3)
    assert thread.is_alive()
    run.release[2].set()
    thread.join(timeout=30)
    # ... and only for it: the sync is done although batch 3 (queued) has not run; batch 3
    # then starts on the new weights
    assert not thread.is_alive() and run.version == 1
    assert run.started[3].wait(timeout=30) and run.started_on[3] == 1
    for m in range(3, 7):
        run.release[m].set()
    out = {}
    for step in range(2, 7):
        batch, metrics = p.take(step, PhaseTimer())
        # the version the pipeline recorded is the one the engines held
        assert metrics["staleness/max"] == step - 1 - batch.version <= 2, (step, metrics)
        out[step] = batch.version
        sync_in_thread(p, run).join(timeout=30)
    assert out[2] == 0 and out[3] == 1  # batch 3: one version newer than the schedule's
    p.shutdown()


def test_deterministic_sync_waits_for_every_queued_batch():
    run, p = first_sync_with_batch_2_running(deterministic=True)
    thread = sync_in_thread(p, run)
    run.release[2].set()  # the sync waits for batch 2 ...
    assert run.started[3].wait(timeout=30)
    thread.join(timeout=0.3)
    assert thread.is_alive() and run.started_on[3] == 0  # ... and batch 3, on version 0
    run.release[3].set()
    thread.join(timeout=30)
    assert not thread.is_alive() and run.version == 1
    for m in range(4, 7):
        run.release[m].set()
    assert p.take(2, PhaseTimer())[0].version == 0 and p.take(3, PhaseTimer())[0].version == 0
    p.shutdown()


def test_free_running_sync_wait_has_a_deadline_and_shutdown_frees_the_gate():
    run = GatedRun(last=3)
    p = RolloutPipeline(run.collect, max_staleness=2, last_step=3,
                        wait=lambda f: f.result(timeout=0.2), deterministic=False)
    run.release[1].set()
    p.take(1, PhaseTimer())
    assert run.started[2].wait(timeout=30)
    with pytest.raises(TimeoutError):  # batch 2 never ends: the wait gives up, no hang
        with p.weights_changing():
            pytest.fail("synced under a running generation")
    run.release[2].set()  # batch 3 now waits at the closed gate; shutdown lets it go
    p.shutdown()
    with pytest.raises(concurrent.futures.CancelledError):
        p.queued[3].future.result(timeout=30)
    assert not run.started[3].is_set()


def test_free_running_config():
    cfg = load_config(RLConfig, DEMO_SIZED, ["rollout.mode=async", "rollout.deterministic=false"])
    assert not cfg.rollout.deterministic
    assert load_config(RLConfig, DEMO_SIZED, []).rollout.deterministic  # the default


@pytest.mark.parametrize("overrides", [
    ["rollout.deterministic=false"],  # mode sync: nothing generates ahead
    ["rollout.mode=async", "rollout.partial_chunk_tokens=2", "rollout.deterministic=false"],
])
def test_free_running_refused_where_it_cannot_work(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, DEMO_SIZED, overrides)
    assert err.value.field == "rollout.deterministic" and "one_step or async" in str(err.value)
