"""A rank's compiled share of a plan: the same messages, in the same order, as walking the plan;
compiled once per plan fingerprint; a pickled plan recomputes its fingerprint from contents."""
import pytest

import pickle
from dataclasses import replace

from mcore_rl.layouts import megatron_shards, vllm_shards
from mcore_rl.layouts.layout import box_slices
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.schedule import ScheduleCache, compile_schedule

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

MICRO = get_preset("micro")


def _plan(bucket=16 << 10):
    return build_plan(megatron_shards(MICRO, ParallelConfig(tp=2, pp=2)), vllm_shards(MICRO, 2),
                      bucket_bytes=bucket)


def test_schedule_has_exactly_this_ranks_messages_in_plan_order():
    plan = _plan()
    for rank in range(plan.world_size):
        sending = rank < plan.num_src
        schedule = compile_schedule(plan, rank, sending=sending)
        assert len(schedule.rounds) == len(plan.rounds)
        for k, msgs in enumerate(schedule.rounds):
            want = {(s if not sending else d): [
                ((t.src_key, box_slices(t.src_box)) if sending else
                 (t.dst_key, box_slices(t.dst_box))) for t in transfers]
                for (s, d), transfers in plan.messages(k).items() if (s if sending else d) == rank}
            assert {peer: [(key, sl) for key, sl, _ in items] for peer, items in msgs} == want
        if not sending:
            assert schedule.shapes == plan.dst_shapes[rank]
            assert sum(schedule.covered.values()) * plan.element_size == \
                plan.bytes_received()[rank]
    # peers: only the messages to those ranks
    only = compile_schedule(plan, 0, sending=True, peers={plan.num_src})
    assert {peer for msgs in only.rounds for peer, _ in msgs} == {plan.num_src}


def test_cache_compiles_once_per_plan_fingerprint():
    cache, plan = ScheduleCache(capacity=2), _plan()
    first = cache.get(plan, 0, sending=True)
    assert cache.get(pickle.loads(pickle.dumps(plan)), 0, sending=True) is first  # same plan
    other = _plan(bucket=32 << 10)
    assert other.fingerprint() != plan.fingerprint()
    assert cache.get(other, 0, sending=True) is not first


def test_a_pickled_plan_recomputes_its_fingerprint():
    plan = _plan()
    plan.fingerprint()
    copy = pickle.loads(pickle.dumps(plan))
    assert "_fingerprint" not in copy.__dict__
    assert copy.fingerprint() == plan.fingerprint()
    t = copy.rounds[0][0]
    copy.rounds[0][0] = replace(t, dst_key=t.dst_key + "x")
    edited = pickle.loads(pickle.dumps(copy))
    assert edited.fingerprint() != plan.fingerprint()
