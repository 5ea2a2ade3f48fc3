"""Device twin of the FP8 sync (see tests/device_twin.py): what a trainer rank computes from
shards on its GPU — each weight's amax, the quantized regions and block scales it sends — and
what an engine rank installs into FP8 parameters on its GPU stay on that device; numbers:
tests/resharding/test_fp8.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from device_twin import TWIN, assert_on_twin
from mcore_rl.layouts import hf_shards, materialize_rank, megatron_shards, vllm_fp8_names, \
    vllm_shards
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.fp8 import (block_quantized_sources, installed_scales, per_block_units,
                                     per_tensor_units, quantized_sources, sent_amax)
from mcore_rl.rollout.install import install_from_iterator

from tests.resharding.test_fp8 import DENSE

pytestmark = [pytest.mark.device_twin, pytest.mark.fast]


def _plan_and_shards(units):
    src, dst = megatron_shards(DENSE, ParallelConfig(tp=2)), vllm_shards(DENSE, 2)
    plan = build_plan(src, dst, bucket_bytes=1 << 20, element_size=2)
    plan = replace(plan, fp8=units(plan, dst, vllm_fp8_names(DENSE).__contains__))
    g = torch.Generator().manual_seed(3)
    hf = {n: torch.randn(s, generator=g) for n, s in hf_shards(DENSE).hf_shapes.items()}
    shards = {k: v.to(TWIN) for k, v in materialize_rank(src, 0, hf.__getitem__).items()}
    return plan, shards


def test_a_per_tensor_senders_amax_quantized_regions_and_scales_stay_on_its_device():
    plan, shards = _plan_and_shards(per_tensor_units)
    amax = sent_amax(plan, 0, shards, torch.bfloat16)
    sources = quantized_sources(plan, 0, shards, torch.bfloat16, amax)
    assert sources and amax.shape == (plan.fp8.count,)
    assert_on_twin(amax, *sources.values())
    scales = installed_scales(plan, plan.num_src, amax, torch.bfloat16)
    assert scales
    assert_on_twin(*(s for _, s in scales))


def test_a_block_wise_senders_regions_and_block_scales_stay_on_its_device():
    plan, shards = _plan_and_shards(per_block_units)
    regions, scales = block_quantized_sources(plan, 0, shards, torch.bfloat16)
    assert regions and regions.keys() == scales.keys()
    assert_on_twin(*regions.values(), *scales.values())
    assert all(r.dtype == torch.uint8 and s.dtype == torch.float32
               for r, s in zip(regions.values(), scales.values(), strict=True))


class _Linear(nn.Module):
    """An FP8 linear as vLLM's online methods leave it on a GPU: the weight in one byte per
    element in the kernel's layout, its scale(s)."""

    def __init__(self, weight: torch.Tensor, **scales: torch.Tensor):
        super().__init__()
        self.output_size_per_partition, self.input_size_per_partition = 4, 6
        self.weight = nn.Parameter(weight, requires_grad=False)
        for name, value in scales.items():
            setattr(self, name, nn.Parameter(value, requires_grad=False))


def test_fp8_weights_and_scales_install_in_place_on_the_engines_device():
    fp8 = torch.float8_e4m3fn
    model = nn.Module()
    model.per_tensor = _Linear(torch.zeros(4, 6, dtype=fp8, device=TWIN).t(),
                               weight_scale=torch.ones(1, device=TWIN))
    model.block = _Linear(torch.zeros(4, 6, dtype=fp8, device=TWIN),
                          weight_scale_inv=torch.ones(1, 1, device=TWIN))
    before = {n: p for n, p in model.named_parameters()}
    names = install_from_iterator(model, [
        ("per_tensor.weight", torch.zeros(4, 6, dtype=torch.uint8, device=TWIN)),
        ("per_tensor.weight_scale", torch.ones(1, device=TWIN)),
        ("block.weight", torch.zeros(4, 6, dtype=torch.uint8, device=TWIN)),
        ("block.weight_scale_inv", torch.ones(1, 1, device=TWIN))])
    assert names == sorted(before)
    assert all(p is before[n] for n, p in model.named_parameters())  # the same parameters
    assert_on_twin(*model.parameters())
