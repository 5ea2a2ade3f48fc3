"""The RL config speaks one vocabulary: every deadline is in `deadlines`, and keys that moved
there fail with a message naming the new place (no Ray, no vLLM: pure config)."""

from __future__ import annotations

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.runconfig import RLConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_every_deadline_is_in_the_deadlines_section():
    cfg = load_config(RLConfig, None, ["deadlines.engine_call_s=90", "deadlines.reward_model_s=45"])
    assert (cfg.deadlines.engine_call_s, cfg.deadlines.reward_model_s) == (90.0, 45.0)
    assert (cfg.deadlines.startup_s, cfg.deadlines.gen_s) == (600.0, 300.0)  # defaults kept
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, ["deadlines.engine_call_s=0"])
    assert err.value.field == "deadlines.engine_call_s"


@pytest.mark.parametrize("override, new_place", [
    ("rollout.start_timeout_s=60", "deadlines.startup_s"),
    ("rollout.call_timeout_s=60", "deadlines.engine_call_s"),
    ("reward_model.timeout_s=60", "deadlines.reward_model_s"),
])
def test_an_old_deadline_key_names_where_it_moved(tmp_path, override, new_place):
    key, value = override.split("=")
    section, leaf = key.split(".")
    (tmp_path / "old.yaml").write_text(f"{section}:\n  {leaf}: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, tmp_path / "old.yaml")
    assert err.value.field == key
    assert f"this key moved: set {new_place}" in str(err.value)


# --- one seed ---------------------------------------------------------------------------------

def test_every_stream_is_hashed_from_the_run_seed():
    from mcore_rl.config.seeds import STREAMS, derive_seed

    streams = [derive_seed(0, s) for s in STREAMS]
    assert len(set(streams)) == len(STREAMS)  # each stream its own seed
    assert streams == [derive_seed(0, s) for s in STREAMS]  # a pure function
    moved = [derive_seed(7, s) for s in STREAMS]
    assert not set(moved) & set(streams)  # all move together with the run's seed
    assert all(0 <= s < 2 ** 31 for s in streams + moved)  # numpy-seedable (vLLM, megatron)
    # a stream's keys (e.g. step, attempt) mix in: no key tuple is another's plus an offset
    assert len({derive_seed(0, "data", k, a) for k in range(200) for a in range(4)}) == 800
    assert derive_seed(0, "data", 2, 0) != derive_seed(0, "data", 1, 1)
    with pytest.raises(ValueError, match="unknown seed stream 'weights'"):
        derive_seed(0, "weights")


@pytest.mark.parametrize("override, stream", [
    ("model.seed=3", "model"),
    ("train.seed=3", "train"),
    ("warmup.train.seed=3", "train"),
    ("critic_train.seed=3", "train"),
    ("rollout.seed=3", "engine"),
])
def test_an_old_seed_key_says_to_use_the_run_seed(override, stream):
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, None, [override])
    assert err.value.field == override.split("=")[0]
    assert f"set the top-level seed; this stream is derive_seed(seed, '{stream}')" in \
        str(err.value)


def test_train_lm_has_one_seed_too():
    from mcore_rl.train_lm import LMRunConfig

    assert load_config(LMRunConfig, None, ["seed=5"]).seed == 5
    for old in ("task_seed=1", "train.seed=1"):
        with pytest.raises(ConfigError, match="set the top-level seed"):
            load_config(LMRunConfig, None, [old])
