"""Device twin of the sync digest (see tests/device_twin.py): every digest a sync takes is
computed on the device of the tensors it digests — the senders' parameters, the receivers'
installed tensors — with no host copy of a weight and no host tensor mixed in (on `meta` one
would raise). Only the comparison's small vector of digests goes to the host, once per sync
(`DigestTally.vector`), which is not run here."""

from __future__ import annotations

import pytest
import torch

from device_twin import TWIN, assert_on_twin
from mcore_rl.layouts import megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan, send_shards
from mcore_rl.resharding.digest import DigestLedger, region_digest, tensor_digest

pytestmark = [pytest.mark.device_twin, pytest.mark.fast]

MICRO = get_preset("micro")


class _Done:
    def wait(self, *_):
        return True


class _NoWire:
    """A sync group that moves nothing (the bytes are not what this twin checks)."""

    def send(self, tensors, peer, tag):
        return _Done()

    recv = send


@pytest.mark.parametrize("dtype,wire", [(torch.float32, torch.float32),
                                        (torch.bfloat16, torch.bfloat16),
                                        (torch.float32, torch.bfloat16),  # cast block by block
                                        (torch.float64, torch.float64)])  # two units / element
def test_region_and_tensor_digests_stay_on_the_device(dtype, wire):
    x = torch.empty(6, 40, dtype=dtype, device=TWIN)
    d = region_digest(x[:, 8:24], ((2, 8), (8, 24)), (8, 40), dtype=wire)
    assert_on_twin(d, tensor_digest(x, dtype=wire), tensor_digest(x[0, 0]))
    assert d.dtype == torch.int32 and d.shape == (2,)


def test_a_senders_digests_are_taken_on_its_parameters_device():
    """send_shards digests every piece it sends (TP2 → TP2, a bf16 wire from fp32
    parameters: the cast happens on the device too) into a tally on that device."""
    src = megatron_shards(MICRO, ParallelConfig(tp=2))
    plan = build_plan(src, vllm_shards(MICRO, 2), bucket_bytes=16 << 10, element_size=2)
    params = {key: torch.empty(local.shape, device=TWIN) for key, local in src.ranks[0].items()}
    tally = DigestLedger(plan).tally(TWIN, sending=True)
    send_shards(plan, _NoWire(), 0, params, dtype=torch.bfloat16, digests=tally)
    assert len(tally._digests) > 10
    assert_on_twin(*tally._digests)


def test_a_receivers_digests_are_taken_on_its_installed_tensors_device():
    plan = build_plan(megatron_shards(MICRO, ParallelConfig(tp=2)), vllm_shards(MICRO, 2))
    me = plan.num_src
    tally = DigestLedger(plan).tally(TWIN, sending=False)
    for key, shape in plan.dst_shapes[me].items():
        tally.add_installed(me, key, torch.empty(shape, device=TWIN))
    assert len(tally._digests) == len(plan.dst_shapes[me])
    assert_on_twin(*tally._digests)
