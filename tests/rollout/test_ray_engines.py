"""Two TP=1 engines in Ray actors (the session's Ray, bound to loopback): prompts spread over
engines come back in prompt order, a sync reaches both engines (engine-major sync ranks), and
failures — an engine that cannot start, a call that misses its deadline, an engine process
that is killed — raise errors naming the engine and the phase, within the deadline.

Tests run in file order: the last two leave engine 1 dead, and the one after them restarts it
(RayEngines.restart), kills it again in the middle of a sync that engine 0 takes part in, and
brings both back into a new sync group. The module's engines are checked to leave nothing in
the session's Ray when they stop; each test that starts engines of its own, when it ends."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from mcore_rl.models.hf_reference import greedy_generate
from mcore_rl.rollout import RayEngines, RolloutConfig, RolloutError, SamplingConfig
from tests.support.ray_cluster import leaves_nothing

from .helpers import MAX_MODEL_LEN, Trainer, hf_model_with, hf_state, perturbed, prompts

# cpu_threads: each engine's torch threads, set by the engine (Ray's default would be 1)
CFG = RolloutConfig(engines=2, max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25, block_size=32,
                    cpu_threads=2, mode="one_step")
DEADLINES = dict(start_timeout_s=240.0, call_timeout_s=60.0)  # a run's startup_s, engine_call_s
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)


def _in_engine(engines, i, fn):
    """fn() run in engine i's process (fn is pickled by value: a lambda or a nested def,
    since the workers cannot import this test module)."""
    import ray

    return ray.get(engines._actors[i].__ray_call__.remote(lambda _: fn()))


@pytest.fixture(scope="module")
def engines(ray_session, micro_dir):
    import ray

    # the session's Ray (tests/support/ray_cluster.py) is init_local_ray's: loopback only
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    with leaves_nothing(ray_session, "test_ray_engines's engines"):
        start = time.perf_counter()
        eng = RayEngines(micro_dir, CFG, **DEADLINES, wait=False)  # as a run starts them
        assert eng.pids == [] and eng.num_engines == 2  # created, not yet waited for
        eng.wait_ready()
        assert len(eng.pids) == 2 and all(pid != os.getpid() for pid in eng.pids)
        assert [where["threads"] for where in eng.where] == [2, 2]
        # ... whose idle OpenMP threads sleep rather than spin beside the training ranks
        # (mode one_step: rollout/vllm_env.engine_actor_env)
        assert _in_engine(eng, 0, lambda: os.environ.get("OMP_WAIT_POLICY")) == "PASSIVE"
        print(f"2 Ray engines ready in {time.perf_counter() - start:.1f} s "
              f"(vLLM start-up {[round(s, 1) for s in eng.startup_s]} s)")
        yield eng
        eng.shutdown()


def test_engine_that_cannot_start_is_named(ray_cluster, tmp_path):
    # Runs first: the failed actor is killed before the real engines take both Ray CPUs.
    with pytest.raises(RolloutError, match=r"rollout engine 0, start-up: .*no config.json"):
        RayEngines(tmp_path, RolloutConfig(engines=1), start_timeout_s=60.0,
                   call_timeout_s=60.0)


def test_a_late_engine_is_not_called_until_admitted_and_one_that_fails_is_named(ray_cluster,
                                                                              tmp_path):
    # rollout.startup_engines=1 of 2: engine 1 starts only when asked, takes no calls until
    # admitted, and its failure to start surfaces at admission, named, with the late engines
    # stopped. No vLLM starts here (no config.json fails first), so this runs in seconds.
    import ray

    cfg = RolloutConfig(engines=2, startup_engines=1, cpus_per_engine=0)
    late = RayEngines(tmp_path, cfg, start_timeout_s=60.0, call_timeout_s=60.0, wait=False)
    try:
        assert late.num_engines == 1 and late.late_pending == 0
        late.start_late_engines()
        assert late.num_engines == 1 and late.late_pending == 1
        actor = late._late[0][1]
        with pytest.raises(RolloutError, match=r"rollout engine 1, start-up: .*no config.json"):
            late.admit_late_engines(wait=True)
        assert late.num_engines == 1 and late.late_pending == 0
        with pytest.raises(ray.exceptions.RayActorError):  # stopped, not left running
            ray.get(actor.ready.remote(), timeout=30.0)
    finally:
        late.shutdown(grace_s=1.0)


def test_engines_still_starting_are_stopped_within_the_grace(ray_cluster, micro_dir):
    # A run whose actor ranks fail while its engines start stops them without waiting for
    # their vLLM start-up (RLController: shutdown(grace_s=5.0)).
    import ray
    from ray.exceptions import RayActorError

    starting = RayEngines(micro_dir, RolloutConfig(engines=1, max_model_len=MAX_MODEL_LEN,
                                                   kv_cache_gib=0.25), **DEADLINES, wait=False)
    actor = starting._actors[0]
    start = time.perf_counter()
    starting.shutdown(grace_s=1.0)
    assert time.perf_counter() - start < 10.0 and starting.num_engines == 0
    with pytest.raises(RayActorError):
        ray.get(actor.ready.remote(), timeout=30.0)


def test_results_come_back_in_prompt_order(engines, micro_dir):
    ps = prompts(7, 10, seed=9)
    greedy = engines.generate(ps, GREEDY)  # engine 0: prompts 0-2, engine 1: prompts 3-6
    hf = greedy_generate(hf_model_with(micro_dir, hf_state(micro_dir)), ps, max_new_tokens=8)
    assert [list(s[0].token_ids) for s in greedy] == hf
    # Seeds follow the global prompt index: one engine alone samples the same groups.
    sp = SamplingConfig(max_tokens=8, n=3, seed=4)
    spread = engines.generate(ps, sp)
    alone = engines.generate(ps, sp, engines=[1])
    assert [[c.token_ids for c in s] for s in spread] == [[c.token_ids for c in s] for s in alone]
    assert len(spread) == 7 and all(len(s) == 3 for s in spread)
    # eager engines compiled nothing: vLLM's sampler would compile its log-prob rank helper
    def frames_compiled():
        from torch._dynamo.utils import counters

        return sum(counters["frames"].values())

    assert [_in_engine(engines, i, frames_compiled) for i in range(2)] == [0, 0]


def test_sync_reaches_every_engine(engines, micro_dir):
    ps = prompts(3, 40, seed=10)
    w0 = hf_state(micro_dir)
    w1 = perturbed(w0, seed=5)
    trainer = Trainer(tp=1, engines=2)  # sync ranks: trainer 0, engine 0 → 1, engine 1 → 2
    engines.check_shapes(trainer.plan, first_sync_rank=1)
    trainer.connect(engines)
    reports, _ = trainer.sync(engines, w1)
    assert [r.ranks[0].sync_rank for r in reports] == [1, 2]
    print(f"2-engine sync via Ray: {[r.as_dict() for r in reports]}")
    hf_w1 = greedy_generate(hf_model_with(micro_dir, w1), ps, max_new_tokens=8)
    for i in range(2):
        assert [list(s[0].token_ids) for s in engines.generate(ps, GREEDY, engines=[i])] == hf_w1
    trainer.sync(engines, w0)
    trainer.disconnect(engines)


def test_stuck_call_raises_at_its_deadline(engines):
    # Engine 0 is stuck for 2 s (its actor runs one call at a time), so the generate call
    # cannot be answered within its 0.3 s on any machine; a long generation instead finished
    # in time on a fast one.
    stuck = engines._actors[0].__ray_call__.remote(lambda _: time.sleep(2.0))
    start = time.perf_counter()
    with pytest.raises(RolloutError, match=r"rollout engine 0, generate: no reply within 0.3 s"):
        engines.generate(prompts(16, 10, seed=11), GREEDY, timeout_s=0.3)
    assert time.perf_counter() - start < 1.5  # at the deadline, not when the engine frees up
    import ray

    ray.get(stuck, timeout=30.0)


def test_killed_engine_is_named(engines):
    os.kill(engines.pids[1], signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(RolloutError, match=r"rollout engine 1, generate: engine process died"):
        engines.generate(prompts(4, 10), GREEDY, timeout_s=30.0)
    assert time.perf_counter() - start < 15.0


def test_a_dead_engine_restarts_and_a_survivor_rejoins_after_a_sync_lost_a_peer(engines,
                                                                              micro_dir):
    from mcore_rl.resharding import send_shards, verify_plan

    assert engines.dead_engines() == [1]  # killed by the test above
    ps = prompts(3, 40, seed=10)
    w0, old = hf_state(micro_dir), engines.pids[1]
    w1 = perturbed(w0, seed=7)
    start = time.perf_counter()
    engines.restart([1])
    restart_s = time.perf_counter() - start
    assert engines.pids[1] != old and engines.dead_engines() == [] and engines.probe(1) is None
    # a fresh engine serves the model directory's weights until it is synced
    hf_w0 = greedy_generate(hf_model_with(micro_dir, w0), ps, max_new_tokens=8)
    assert [list(s[0].token_ids) for s in engines.generate(ps, GREEDY, engines=[1])] == hf_w0

    trainer = Trainer(tp=1, engines=2, timeout_s=30.0)
    trainer.connect(engines)
    engines.begin_sync(trainer.plan)  # both engines wait for their shards
    os.kill(engines.pids[1], signal.SIGKILL)
    with pytest.raises(Exception):  # the group lost a member: the trainer's side fails
        verify_plan(trainer.plan, trainer.group, 0)
        send_shards(trainer.plan, trainer.group, 0, w1, dtype=torch.float32, timeout_s=30.0)
    assert engines.dead_engines() == [1]
    trainer.group.shutdown()  # the trainer leaves the broken group ...
    engines.abandon_sync([0])  # ... engine 0 waits out its failed install and leaves it too
    engines.restart([1])
    trainer.connect(engines)  # a new group, a new prefix
    trainer.sync(engines, w1)
    hf_w1 = greedy_generate(hf_model_with(micro_dir, w1), ps, max_new_tokens=8)
    for i in range(2):
        assert [list(s[0].token_ids) for s in engines.generate(ps, GREEDY, engines=[i])] == hf_w1
    trainer.disconnect(engines)
    print(f"engine restart: {restart_s:.1f} s (vLLM start-up {engines.startup_s[1]:.1f} s)")
