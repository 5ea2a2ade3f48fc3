"""The install of FP8 fused experts on a non-CPU device (`meta`, as the device twins run, see
tests/device_twin.py): every parameter stays the loaded one, on its device. Not among the
device twins scripts/gpu_check.sh reruns on CUDA: the install calls vLLM's own quantization
and conversion to its kernel's format, and that machine has no vLLM; on a GPU with vLLM the
engine tests run it (tests/rollout/test_engine_fp8_moe.py)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from device_twin import TWIN, assert_on_twin
from mcore_rl.rollout.moe_install import MoEInstaller

pytestmark = pytest.mark.fast

E = 2


class _Fp8Method:
    """vLLM's online block-FP8 MoE method after the first load, on a GPU backend whose kernel
    format is the loaded layout (Triton's)."""

    def __init__(self):
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

        self.fp8_backend = Fp8MoeBackend.TRITON


def _fp8_experts(device, block: bool = True) -> nn.Module:
    """An FP8 fused-expert layer (E experts of 2·128 × 128 and 128 × 128), as vLLM's online
    block method (one scale per block of each) or per-tensor method (one per expert) leaves
    it."""
    fp8 = torch.float8_e4m3fn
    module = nn.Module()
    module.moe_config = types.SimpleNamespace(intermediate_size_per_partition_unpadded=128,
                                              hidden_dim_unpadded=128)
    module.local_num_experts, module.hidden_size = E, 128
    module.intermediate_size_per_partition = 128
    module.quant_method = _Fp8Method()
    for leaf, shape, grid in (("w13_weight", (E, 256, 128), (E, 2, 1)),
                              ("w2_weight", (E, 128, 128), (E, 1, 1))):
        setattr(module, leaf, nn.Parameter(torch.zeros(shape, device=device).to(fp8),
                                           requires_grad=False))
        scale, shape = (f"{leaf}_scale_inv", grid) if block else (f"{leaf}_scale", (E,))
        setattr(module, scale, nn.Parameter(torch.ones(shape, device=device),
                                            requires_grad=False))
    return module


def test_fp8_experts_install_in_place_on_device():
    """An FP8 fused-expert layer on the twin device: w13 from the senders (FP8 bytes and
    block scales, sent before it), w2 in BF16 quantized by the install itself; every
    parameter stays the loaded one, on its device (its kernel holds them)."""
    module = _fp8_experts(TWIN)
    before = dict(module.named_parameters())
    installer = MoEInstaller()
    computed = [
        installer.add("experts.w13_weight_scale_inv", module, "w13_weight_scale_inv",
                      torch.ones(E, 2, 1, device=TWIN)),
        installer.add("experts.w13_weight", module, "w13_weight",
                      torch.zeros(E, 256, 128, dtype=torch.uint8, device=TWIN)),
        installer.add("experts.w2_weight", module, "w2_weight",
                      torch.zeros(E, 128, 128, dtype=torch.bfloat16, device=TWIN))]
    installer.finish()
    assert computed == [[], [], ["experts.w2_weight_scale_inv"]]
    assert all(p is before[n] for n, p in module.named_parameters())  # the loaded ones
    assert_on_twin(*module.parameters())


def test_per_tensor_fp8_experts_install_in_place_on_device():
    """Per tensor: both weights' FP8 bytes with one scale per expert, sent before them."""
    module = _fp8_experts(TWIN, block=False)
    before = dict(module.named_parameters())
    installer = MoEInstaller()
    for leaf, shape in (("w13_weight", (E, 256, 128)), ("w2_weight", (E, 128, 128))):
        assert installer.add(f"experts.{leaf}_scale", module, f"{leaf}_scale",
                             torch.ones(E, device=TWIN)) == []
    for leaf, shape in (("w13_weight", (E, 256, 128)), ("w2_weight", (E, 128, 128))):
        assert installer.add(f"experts.{leaf}", module, leaf,
                             torch.zeros(shape, dtype=torch.uint8, device=TWIN)) == []
    installer.finish()
    assert all(p is before[n] for n, p in module.named_parameters())
    assert_on_twin(*module.parameters())
