"""Device twin of the MoE install into vLLM's fused experts (see tests/device_twin.py), and
the check that a synced layer lands in the parameters vLLM loaded (CUDA graphs captured their
storage: a replaced parameter would never be read). FP8 experts:
tests/rollout/test_fp8_experts_on_device.py."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from device_twin import TWIN, assert_on_twin
from mcore_rl.rollout.install import install_from_iterator, receive_target
from mcore_rl.rollout.moe_install import MoEInstaller

pytestmark = [pytest.mark.device_twin, pytest.mark.fast]

E, I, H, I_PAD = 2, 3, 4, 4


class _Method:
    """vLLM's quant method after the first load (a kernel set up, nothing to repack)."""

    moe_kernel = None

    def process_weights_after_loading(self, layer):
        self.calls = getattr(self, "calls", 0) + 1


def _experts(device, *, packed_shape: bool = False) -> nn.Module:
    """A RoutedExperts stand-in: what `is_fused_moe` and `_sizes` read."""
    module = nn.Module()
    module.moe_config = types.SimpleNamespace(intermediate_size_per_partition_unpadded=I,
                                              hidden_dim_unpadded=H)
    module.local_num_experts, module.hidden_size = E, H
    module.intermediate_size_per_partition = I_PAD
    module.quant_method = _Method()
    w13 = (E, 2 * I_PAD * H) if packed_shape else (E, 2 * I_PAD, H)  # CPU prepack: reshaped
    module.w13_weight = nn.Parameter(torch.full(w13, 9.0, device=device), requires_grad=False)
    module.w2_weight = nn.Parameter(torch.full((E, H, I_PAD), 9.0, device=device),
                                    requires_grad=False)
    module.w13_weight.weight_loader = "loader13"
    return module


def _install(module, device):
    installer = MoEInstaller()
    installer.add("layers.0.mlp.experts.w13_weight", module, "w13_weight",
                  torch.ones(E, 2 * I, H, device=device))
    installer.add("layers.0.mlp.experts.w2_weight", module, "w2_weight",
                  torch.ones(E, H, I, device=device))
    installer.finish()


def test_moe_install_on_device():
    module = _experts(TWIN)
    _install(module, TWIN)
    assert_on_twin(module.w13_weight, module.w2_weight)
    assert module.quant_method.calls == 1


def test_moe_install_copies_into_the_loaded_parameters():
    """B5: the install replaced vLLM's expert parameters with fresh ones."""
    module = _experts("cpu")
    old13, old2 = module.w13_weight, module.w2_weight
    ptr13, ptr2 = old13.data_ptr(), old2.data_ptr()
    _install(module, "cpu")
    assert module.w13_weight is old13 and module.w2_weight is old2
    assert (module.w13_weight.data_ptr(), module.w2_weight.data_ptr()) == (ptr13, ptr2)
    w13 = module.w13_weight
    assert w13[:, :I, :H].eq(1).all() and w13[:, I_PAD:I_PAD + I, :H].eq(1).all()
    assert w13[:, I:I_PAD].eq(0).all()  # the padding rows are zeroed, not left stale
    assert module.w2_weight[:, :, :I].eq(1).all() and module.w2_weight[:, :, I:].eq(0).all()


def test_moe_install_replaces_a_prepacked_parameter():
    """The CPU kernel prepacked the loaded parameter into another shape: a fresh unpacked one
    takes its place, with its attributes (the repack then runs on it)."""
    module = _experts("cpu", packed_shape=True)
    old13 = module.w13_weight
    _install(module, "cpu")
    assert module.w13_weight is not old13
    assert module.w13_weight.shape == (E, 2 * I_PAD, H)
    assert module.w13_weight.weight_loader == "loader13"


def _dense_model(device) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 3, bias=False, device=device))
    return model.requires_grad_(False)


def test_a_shard_received_into_its_parameter_is_installed_without_a_copy():
    """N13: a whole shard is received straight into the parameter it replaces
    (`receive_target`), and the install then copies nothing: same storage, same pointer."""
    model = _dense_model("cpu")
    param, ptr = model[0].weight, model[0].weight.data_ptr()
    target = receive_target(model, "0.weight", (3, 4), torch.float32, "cpu")
    assert target.data_ptr() == ptr
    target.copy_(torch.arange(12.0).view(3, 4))  # what the transport does as bytes land
    seen = {}
    names = install_from_iterator(model, [("0.weight", target)],
                                  installed=lambda n, t: seen.update({n: t}))
    assert names == ["0.weight"] and model[0].weight is param and param.data_ptr() == ptr
    assert torch.equal(param, torch.arange(12.0).view(3, 4)) and seen["0.weight"] is param
    # whatever the parameter cannot take goes through a buffer and a copy
    for shape, dtype, device in [((4, 3), torch.float32, "cpu"), ((3, 4), torch.bfloat16, "cpu"),
                                 ((3, 4), torch.float32, TWIN)]:
        assert receive_target(model, "0.weight", shape, dtype, device) is None
    assert receive_target(model, "1.weight", (3, 4), torch.float32, "cpu") is None
    experts = _experts("cpu")  # fused experts hold a kernel's layout: through the installer
    parent = nn.Module()
    parent.experts = experts
    assert receive_target(parent, "experts.w2_weight", (E, H, I_PAD), torch.float32,
                          "cpu") is None


def test_receive_target_on_device():
    model = _dense_model(TWIN)
    target = receive_target(model, "0.weight", (3, 4), torch.float32, TWIN)
    assert_on_twin(target)
    install_from_iterator(model, [("0.weight", target)])
    assert_on_twin(model[0].weight)
