"""The watchdog: one worker is stalled on purpose — an actor rank before a collective (its TP
peer then waits inside the collective), or an engine inside generation. The step must end
within the deadline plus a few seconds with an error naming the phase and the late workers,
and every worker must have dumped its Python stacks."""

import time

import pytest

from mcore_rl.config import load_config
from mcore_rl.launch.watchdog import WatchdogTimeout
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED

pytestmark = pytest.mark.slow  # end-to-end: started first on the parallel workers

DEADLINE = 12.0


@pytest.mark.parametrize("stall, phase, late", [
    ("update_actor@rank1", "update_actor", "actor rank 0, actor rank 1"),
    ("gen@engine0", "gen", "rollout engine 0"),
], ids=["collective", "generation"])
def test_a_stalled_worker_is_named_with_stack_dumps(ray_cluster, tmp_path, stall, phase, late):
    from mcore_rl.rl.controller import RLController
    from mcore_rl.run.lifecycle import build_demo_model

    cfg = load_config(RLConfig, DEMO_SIZED, [
        "warmup.max_steps=0", "steps=1", "prompts_per_step=4", "samples_per_prompt=4",
        "updates_per_batch=1", "train.micro_batch_size=8", "actor.tp=2",
        f"deadlines.train_s={DEADLINE}", f"deadlines.gen_s={DEADLINE}", f"inject_stall={stall}"])
    controller = RLController(cfg, build_demo_model(cfg, tmp_path), tmp_path)
    try:
        controller.reset_optimizer()
        start = time.monotonic()
        with pytest.raises(WatchdogTimeout) as info:
            controller.rl_step(1)
        elapsed = time.monotonic() - start
    finally:
        stopping = time.monotonic()
        controller.shutdown()
        shutdown_s = time.monotonic() - stopping
    err = info.value
    assert err.phase == phase and late in str(err), str(err)
    assert elapsed < DEADLINE + 10, elapsed
    # the stalled worker is killed, not given the clean shutdown's grace (30 s for engines)
    # that it could only answer after its stalled call
    assert shutdown_s < 20, shutdown_s
    names = sorted(p.name for p in err.stacks)
    assert names == ["engine0.stack.txt", "rank0.stack.txt", "rank1.stack.txt"], names
    stalled = tmp_path / "stacks" / f"{stall.split('@')[1]}.stack.txt"
    assert "maybe_stall" in stalled.read_text()
    if phase == "update_actor":  # the healthy peer is stuck inside megatron's schedule
        assert "schedules.py" in (tmp_path / "stacks" / "rank0.stack.txt").read_text()
