"""Engine-failure recovery's config: bad values raise a ConfigError naming the dotted field;
the backoff doubles up to its cap. (The restarts themselves, with real processes and real
SIGKILLs, are in test_survive.py; RayEngines.restart in tests/rollout/test_ray_engines.py.)"""

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.runconfig import RecoveryConfig
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_defaults_and_overrides_load():
    cfg = load_config(RLConfig, DEMO_SIZED, ["recovery.max_engine_restarts=2",
                                       "recovery.inject_kill=gen@2, sync@3"])
    assert cfg.recovery.max_engine_restarts == 2
    assert cfg.recovery.injected_kills() == {("gen", 2), ("sync", 3)}
    assert load_config(RLConfig, DEMO_SIZED, []).recovery == RecoveryConfig()


@pytest.mark.parametrize("override,field,problem", [
    ("recovery.max_engine_restarts=-1", "recovery.max_engine_restarts", "must be >= 0"),
    ("recovery.restart_backoff_s=-0.5", "recovery.restart_backoff_s", "must be >= 0"),
    ("recovery.restart_backoff_max_s=0.5", "recovery.restart_backoff_max_s",
     "must be >= restart_backoff_s=1.0"),
    ("recovery.inject_kill=gen@0", "recovery.inject_kill", "<gen|sync>@<step>"),
    ("recovery.inject_kill=update@2", "recovery.inject_kill", "<gen|sync>@<step>"),
    ("recovery.max_restarts=1", "recovery.max_restarts", ""),  # unknown field, named
])
def test_bad_values_name_the_field(override, field, problem):
    with pytest.raises(ConfigError) as info:
        load_config(RLConfig, DEMO_SIZED, [override])
    assert info.value.field == field and problem in str(info.value), str(info.value)


def test_backoff_doubles_up_to_its_cap():
    cfg = RecoveryConfig(restart_backoff_s=0.5, restart_backoff_max_s=3.0)
    assert [cfg.backoff(a) for a in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_pipeline_whose_engine_died_fails_the_step_at_once():
    """An engine failure that is not recovered (partial rollouts, or out of restarts: the
    EngineFailed raised while a batch ahead is generated) reaches the step waiting for that
    batch at once — nothing waits on the dead engine — and shutdown returns."""
    import time

    from mcore_rl.rollout.pipeline import RolloutPipeline
    from mcore_rl.launch.timing import PhaseTimer
    from mcore_rl.rl.recovery import EngineFailed

    class Batch:
        def __init__(self, step):
            self.step = step

    def collect(step, timer):
        if step >= 2:  # engine 0 died while batch 2 was being generated
            raise EngineFailed("rollout engine(s) [0] died during generate", [0])
        return Batch(step)

    pipeline = RolloutPipeline(collect, max_staleness=1, last_step=5,
                               wait=lambda future: future.result(timeout=30))
    start = time.monotonic()
    assert pipeline.take(1, PhaseTimer())[0].step == 1
    with pytest.raises(EngineFailed, match=r"engine\(s\) \[0\] died"):
        pipeline.quiesce(PhaseTimer(), (0.0, 1.0))  # before step 1's sync: batch 2 failed
    with pytest.raises(EngineFailed):
        pipeline.take(2, PhaseTimer())
    pipeline.shutdown()
    assert time.monotonic() - start < 5.0
