"""No two samples of a run share a seed (issue #43): each RL step's sampling
(`rl.sampler.step_sampling`) seeds each of its samples by hashing the run's seed, the step, the
draw, the prompt's batch index and the sample's (mcore_rl/config/seeds.py). Consecutive steps'
samples on a real engine: tests/rollout/test_engine_tp1.py."""

from __future__ import annotations

import pytest

from mcore_rl.config import load_config
from mcore_rl.config.seeds import derive_seed
from mcore_rl.rl.sampler import step_sampling
from mcore_rl.runconfig import RLConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def run_seeds(cfg: RLConfig, steps: int, attempts: int) -> list[int]:
    """Every sample's seed in `steps` steps of `attempts` draws each."""
    seeds = []
    for step in range(1, steps + 1):
        for attempt in range(attempts):
            sampling = step_sampling(cfg, step, attempt, eos_id=2)
            seeds += [sampling.sample_seed(i, j) for i in range(cfg.prompts_per_step)
                      for j in range(cfg.samples_per_prompt)]
    return seeds


def test_no_two_samples_of_a_run_share_a_seed():
    cfg = load_config(RLConfig, None, ["prompts_per_step=32", "samples_per_prompt=8"])
    seeds = run_seeds(cfg, steps=200, attempts=4)  # dynamic sampling's redraws included
    assert len(seeds) == 200 * 4 * 32 * 8 and len(set(seeds)) == len(seeds)
    # evaluations and warm-up batches draw from streams of their own
    others = {derive_seed(0, "eval"), derive_seed(0, "heldout")} | {
        derive_seed(0, "warmup", step) for step in range(1, 2001)}
    assert not others & set(seeds)


def test_a_run_seed_moves_every_sample_and_a_step_is_a_pure_function_of_its_keys():
    cfg0 = load_config(RLConfig, None, ["prompts_per_step=8", "samples_per_prompt=4"])
    cfg1 = load_config(RLConfig, None, ["prompts_per_step=8", "samples_per_prompt=4", "seed=1"])
    assert not set(run_seeds(cfg0, 20, 2)) & set(run_seeds(cfg1, 20, 2))
    # resume exactness: the same step and draw give the same seeds in any process
    assert run_seeds(cfg0, 20, 2) == run_seeds(cfg0, 20, 2)
    assert step_sampling(cfg0, 7, 1, 2) == step_sampling(cfg0, 7, 1, 2)
