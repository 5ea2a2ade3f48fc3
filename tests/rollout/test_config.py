"""RolloutConfig / SamplingConfig validate themselves and name the field (no vLLM needed)."""

import pytest

from mcore_rl.config import ConfigError, from_dict
from mcore_rl.rollout import RolloutConfig, SamplingConfig
from mcore_rl.rollout.vllm_env import IDLE_THREADS_SLEEP, engine_actor_env

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.mark.parametrize("cls,field,value", [
    (RolloutConfig, "tp", 0),
    (RolloutConfig, "engines", 0),
    (RolloutConfig, "kv_cache_gib", 0.0),
    (RolloutConfig, "gpu_memory_utilization", 1.5),
    (RolloutConfig, "sleep_level", 3),
    (RolloutConfig, "block_size", 20),             # not a multiple of 16
    (RolloutConfig, "cpu_threads", 0),
    (SamplingConfig, "temperature", -0.5),
    (SamplingConfig, "top_p", 0.0),
    (SamplingConfig, "n", 0),
    (SamplingConfig, "max_tokens", 0),
])
def test_bad_values_name_the_field(cls, field, value):
    with pytest.raises(ConfigError) as err:
        cls(**{field: value})
    assert err.value.field == field


def test_threads_bind_needs_one_list_per_rank():
    with pytest.raises(ConfigError, match="cpu_threads_bind"):
        RolloutConfig(tp=2, cpu_threads_bind="0")
    RolloutConfig(tp=2, cpu_threads_bind="0|1")


def test_startup_engines_are_some_of_the_engines_and_not_with_partial_rollouts():
    assert RolloutConfig(engines=2, startup_engines=1).late_engines == 1
    assert RolloutConfig(engines=2).late_engines == 0  # null: every engine starts with the run
    assert RolloutConfig(engines=2, startup_engines=2).late_engines == 0
    for bad in (0, 3):
        with pytest.raises(ConfigError, match=r"must be in \[1, engines=2\]") as err:
            RolloutConfig(engines=2, startup_engines=bad)
        assert err.value.field == "startup_engines"
    with pytest.raises(ConfigError, match="partial rollouts") as err:
        RolloutConfig(engines=2, startup_engines=1, mode="one_step", partial_chunk_tokens=4)
    assert err.value.field == "startup_engines"
    RolloutConfig(engines=2, startup_engines=2, mode="one_step", partial_chunk_tokens=4)


def test_cpu_threads_are_for_in_process_engines():
    # tp > 1: each TP rank is a process placed by cpu_threads_bind (so a config that sets
    # cpu_threads for tp 1 still runs with rollout.tp=2)
    assert RolloutConfig(tp=2, cpu_threads=2, cpu_threads_bind="0|1").in_process_threads is None
    assert RolloutConfig(cpu_threads=2).in_process_threads == 2
    assert RolloutConfig().in_process_threads is None


def test_an_engines_idle_threads_sleep_at_once_only_beside_training():
    # generating while the ranks train: OpenMP threads that spin would take the ranks' cores
    for mode in ("one_step", "async"):
        assert engine_actor_env(RolloutConfig(cpu_threads=2, mode=mode)) == IDLE_THREADS_SLEEP
    # sync: the ranks wait meanwhile; a short spin keeps each small region from waiting for
    # its threads to wake. Threads vLLM places itself (tp > 1, or no count): left as they are
    for cfg in (RolloutConfig(cpu_threads=2), RolloutConfig(mode="one_step"),
                RolloutConfig(tp=2, cpu_threads=2, mode="async", cpu_threads_bind="0|1")):
        assert engine_actor_env(cfg) == {}


def test_a_deadline_key_in_the_rollout_section_says_where_it_moved():
    with pytest.raises(ConfigError, match=r"rollout.start_timeout_s=60: this key moved: set "
                                          r"deadlines.startup_s"):
        from_dict(RolloutConfig, {"start_timeout_s": 60}, prefix="rollout")
    with pytest.raises(ConfigError, match="rollout.call_timeout_s=9: .*deadlines.engine_call_s"):
        from_dict(RolloutConfig, {"call_timeout_s": 9}, prefix="rollout")


def test_loaded_from_yaml_dict_with_prefix():
    cfg = from_dict(RolloutConfig, {"tp": 2, "engines": 3, "kv_cache_gib": 2})
    assert (cfg.tp, cfg.engines, cfg.kv_cache_gib) == (2, 3, 2.0)
    with pytest.raises(ConfigError, match="rollout.tp=0"):
        from_dict(RolloutConfig, {"tp": 0}, prefix="rollout")


def test_sample_seeds_are_hashed_per_prompt_and_sample():
    sp = SamplingConfig(n=4, seed=10)
    seeds = {sp.sample_seed(i, j) for i in range(64) for j in range(4)}
    assert len(seeds) == 64 * 4  # no two samples of the call share a seed
    # nor with the neighbouring calls' seeds (the old `seed + i*n + j` shared all but a few)
    for other in (9, 11, 14):
        assert not seeds & {SamplingConfig(n=4, seed=other).sample_seed(i, j)
                            for i in range(64) for j in range(4)}
    # a call continuing part of a batch seeds its prompts by their batch index
    part = SamplingConfig(n=4, seed=10, first_prompt=5)
    assert part.sample_seed(0, 2) == sp.sample_seed(5, 2)
    assert SamplingConfig().sample_seed(5, 0) is None
    # keyed calls (turns, chunks) get seeds of their own; unseeded stays unseeded
    assert sp.keyed("turn", 1).seed not in (sp.seed, sp.keyed("turn", 2).seed)
    assert SamplingConfig().keyed("turn", 1).seed is None
