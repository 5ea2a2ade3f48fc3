"""A sync plan crosses the wire once per sync group: the sender sends it whole until every
receiver has it, then a reference; receivers resolve references from what they were sent."""

import pickle

import pytest

from mcore_rl.layouts import megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.plan_cache import PlanCache, PlanRef, PlanSender

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def _plan(infer_tp: int):
    spec = get_preset("micro")
    return build_plan(megatron_shards(spec, ParallelConfig(tp=2, pp=2)),
                      vllm_shards(spec, infer_tp), bucket_bytes=1 << 16)


def test_the_whole_plan_goes_until_delivered_then_its_reference_until_a_group_forms():
    plan = _plan(2)
    sender = PlanSender(plan)
    assert sender.payload() is plan  # nobody has it yet
    sender.delivered()
    ref = sender.payload()
    assert ref == PlanRef(plan.fingerprint())
    assert len(pickle.dumps(ref)) < 200 < len(pickle.dumps(plan)) // 10
    sender.joined()  # a new sync group (an engine restarted): its members may not have it
    assert sender.payload() is plan


def test_a_receiver_resolves_references_to_the_plans_it_was_sent():
    cache = PlanCache(size=2)
    first = pickle.loads(pickle.dumps(_plan(2)))  # as a receiver gets it
    assert cache.resolve(first) is first
    assert cache.resolve(PlanRef(_plan(2).fingerprint())) is first  # same contents, same ref
    second, third = _plan(1), _plan(4)
    cache.resolve(second)
    cache.resolve(PlanRef(first.fingerprint()))  # used: kept over `second`
    cache.resolve(third)  # the oldest unused one goes
    assert cache.resolve(PlanRef(first.fingerprint())) is first
    with pytest.raises(KeyError, match=f"plan {second.fingerprint().hex()[:12]} was never "
                                       "sent to this rank"):
        cache.resolve(PlanRef(second.fingerprint()))
