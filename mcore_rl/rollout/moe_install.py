"""Installing synced expert shards into vLLM's fused MoE layers (runs inside a vLLM worker).

vLLM (0.32) holds a layer's routed experts in one module (`RoutedExperts`, `*.experts`) with
two parameters: `w13_weight` [local experts, 2·I, H] (each expert's [gate; up]) and `w2_weight`
[local experts, H, I], I = the expert intermediate size per TP rank. At load, after the weight
loader filled them, `quant_method.process_weights_after_loading(layer)` turns them into the
kernel's format — on CPU (`experts/cpu_moe.py`) it zero-pads I to the kernel's alignment and
prepacks both (`cpu_prepack_moe_weight`), replacing the parameters; their shapes then are no
longer the logical ones, and a `copy_` into them would be wrong.

So a synced layer is installed the way it was loaded: the logical per-rank shards (what
`layouts.vllm_shards` describes; the shapes reported here are those, not the packed ones) are
laid out in the shape `create_weights` gave them (padded sizes where vLLM pads: gate at rows
[0, I), up at rows [I_pad, I_pad + I), as `_load_w13` narrows) and copied into the loaded
parameters where those kept that shape (GPU: CUDA graphs hold their storage), else into fresh
parameters (CPU, prepacked into another shape), and the module's
own `process_weights_after_loading` runs once both of a layer's tensors are in, followed by the
experts' own preparation, which vLLM skips on a reload (see `_install_layer`). One layer's
unpacked experts are held between its w13 and w2 arriving; nothing more.
"""

from __future__ import annotations

import torch
from torch import nn

_LEAVES = ("w13_weight", "w2_weight")


def is_fused_moe(module: nn.Module) -> bool:
    """vLLM's routed-experts module (FusedMoE / RoutedExperts) — recognised by what it holds."""
    return all(hasattr(module, a) for a in ("w13_weight", "w2_weight", "moe_config",
                                            "local_num_experts", "quant_method"))


def _sizes(module: nn.Module) -> tuple[int, int, int, int, int]:
    """(local experts, I, H, I_pad, H_pad): logical and allocated per-rank sizes."""
    cfg = module.moe_config
    i_pad, h_pad = int(module.intermediate_size_per_partition), int(module.hidden_size)
    i = int(getattr(cfg, "intermediate_size_per_partition_unpadded", None) or i_pad)
    h = int(getattr(cfg, "hidden_dim_unpadded", None) or h_pad)
    return int(module.local_num_experts), i, h, i_pad, h_pad


def moe_logical_shape(module: nn.Module, leaf: str) -> tuple[int, ...] | None:
    """The per-rank shape a synced `w13_weight` / `w2_weight` has (None for anything else)."""
    if leaf not in _LEAVES or not is_fused_moe(module):
        return None
    experts, i, h, _, _ = _sizes(module)
    return (experts, 2 * i, h) if leaf == "w13_weight" else (experts, h, i)


# an FP8 fused-expert layer's scale parameters, by weight: vLLM's block method's, its
# per-tensor method's (one per expert)
FP8_SCALES = {leaf: (f"{leaf}_scale_inv", f"{leaf}_scale") for leaf in _LEAVES}
_SCALE_LEAVES = frozenset(s for pair in FP8_SCALES.values() for s in pair)


def is_fp8_experts(module: nn.Module) -> bool:
    """A fused-expert layer vLLM's online FP8 holds in one byte per element."""
    return is_fused_moe(module) and module.w13_weight.dtype.itemsize == 1


def fp8_scale_leaf(module: nn.Module, leaf: str) -> str:
    """The scale parameter of an FP8 fused-expert layer's weight `leaf`."""
    block, per_tensor = FP8_SCALES[leaf]
    return block if hasattr(module, block) else per_tensor


class MoEInstaller:
    """Collects a layer's w13/w2 shards as they arrive; repacks the layer when both are in.
    An FP8 layer's scales (`FP8_SCALES`) come before its weights (the sync sends them first):
    they are kept until the weights they scale arrive; a weight that arrives in the engines'
    dtype (block-wise, sent off the grid) is quantized here, expert by expert, as vLLM's
    loading does."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[str, nn.Module, dict[str, torch.Tensor]]] = {}
        self._scales: dict[int, dict[str, torch.Tensor]] = {}

    def accepts(self, module: nn.Module, leaf: str) -> bool:
        return (leaf in _LEAVES or leaf in _SCALE_LEAVES) and is_fused_moe(module)

    @torch.no_grad()
    def add(self, name: str, module: nn.Module, leaf: str, tensor: torch.Tensor) -> list[str]:
        """Take one tensor; returns the names of scales computed here once the layer is
        installed (an FP8 weight that arrived unquantized), else []."""
        module_name = name.rpartition(".")[0]
        if leaf not in _LEAVES:  # a scale: small, kept until its weight arrives
            self._scales.setdefault(id(module), {})[leaf] = tensor.clone()
            return []
        _, _, got = self._pending.setdefault(id(module), (module_name, module, {}))
        got[leaf] = tensor
        if len(got) < len(_LEAVES):
            return []
        del self._pending[id(module)]
        if not is_fp8_experts(module):
            _install_layer(module, got["w13_weight"], got["w2_weight"])
            return []
        scales = self._scales.pop(id(module), {})
        return [f"{module_name}.{leaf}" for leaf in _install_fp8_layer(module_name, module,
                                                                        got, scales)]

    def finish(self) -> None:
        """Every layer started must have been completed (a repack needs both tensors), and
        every FP8 scale taken must have scaled a weight."""
        if self._scales:
            left = sorted(leaf for scales in self._scales.values() for leaf in scales)
            self._scales.clear()
            raise ValueError(f"FP8 expert scales arrived without their weights: {left[:5]}")
        if self._pending:
            half = [f"{n}.{sorted(set(_LEAVES) - set(got))[0]}"
                    for n, _, got in self._pending.values()]
            self._pending.clear()
            raise ValueError(f"fused MoE layers received only one of w13_weight/w2_weight; "
                             f"missing: {sorted(half)[:5]}")


def _install_layer(module: nn.Module, w13: torch.Tensor, w2: torch.Tensor) -> None:
    experts, i, h, i_pad, h_pad = _sizes(module)
    old = module.w13_weight
    dtype, device = old.dtype, old.device
    new13 = torch.zeros((experts, 2 * i_pad, h_pad), dtype=dtype, device=device)
    new13[:, :i, :h] = w13[:, :i]                       # gate
    new13[:, i_pad:i_pad + i, :h] = w13[:, i:]          # up
    new2 = torch.zeros((experts, h_pad, i_pad), dtype=dtype, device=device)
    new2[:, :h, :i] = w2
    for leaf, data in (("w13_weight", new13), ("w2_weight", new2)):
        _put(module, leaf, data)
    method = module.quant_method
    had_kernel = getattr(method, "moe_kernel", None) is not None
    method.process_weights_after_loading(module)
    kernel = getattr(method, "moe_kernel", None)
    if had_kernel and kernel is not None:
        # vLLM 0.32 (`UnquantizedFusedMoEMethod._setup_kernel`) runs the experts' own
        # preparation — on CPU the pad + grouped-gemm prepack — only on the first load; on a
        # weight update it copies the unpacked tensors in and stops, and the CPU kernel would
        # read them as packed (wrong log-probs: tests/rl/test_moe_sync_integration.py). Redo
        # it as the first load did.
        kernel.fused_experts.process_weights_after_loading(module)


def _install_fp8_layer(name: str, module: nn.Module, weights: dict[str, torch.Tensor],
                       scales: dict[str, torch.Tensor]) -> list[str]:
    """An FP8 fused-expert layer from its two weights — FP8 bytes with their scales, or the
    engines' dtype, quantized here block-wise expert by expert (vLLM's
    `per_block_cast_to_fp8`) — through vLLM's own conversion to its kernel's format
    (`convert_to_fp8_moe_kernel_format`: CPU VNNI packing, GPU shuffles), copied into the
    loaded parameters in place (its kernel holds them). Returns the scale leaves computed
    here."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import (  # lazy: vllm
        convert_to_fp8_moe_kernel_format)

    experts, i, h, i_pad, h_pad = _sizes(module)
    if (i, h) != (i_pad, h_pad):
        raise ValueError(f"{name}: vLLM pads its FP8 experts ({i}x{h} to {i_pad}x{h_pad}); "
                         "the sync's layouts do not")
    fp8 = module.w13_weight.dtype
    quantized, computed = {}, []
    for leaf, tensor in weights.items():
        scale_leaf = fp8_scale_leaf(module, leaf)
        if tensor.itemsize > 1:  # the engines' dtype: this rank quantizes it, as vLLM's loading
            if not scale_leaf.endswith("_inv"):
                raise ValueError(f"{name}.{leaf}: arrived in {tensor.dtype}; per-tensor FP8 "
                                 "experts are quantized by the senders")
            quantized[leaf] = vllm_block_quantize(tensor)
            computed.append(scale_leaf)
        elif scale_leaf in scales:
            quantized[leaf] = (tensor.view(fp8), scales[scale_leaf])
        else:
            raise ValueError(f"{name}.{leaf}: its FP8 bytes arrived without {scale_leaf}")
    (w13, s13), (w2, s2) = quantized["w13_weight"], quantized["w2_weight"]
    w13, w2, s13, s2 = convert_to_fp8_moe_kernel_format(
        fp8_backend=module.quant_method.fp8_backend, layer=module, w13=w13, w2=w2,
        w13_scale=s13, w2_scale=s2, w13_input_scale=None, w2_input_scale=None)
    for leaf, data in (("w13_weight", w13), ("w2_weight", w2),
                       (fp8_scale_leaf(module, "w13_weight"), s13),
                       (fp8_scale_leaf(module, "w2_weight"), s2)):
        param = getattr(module, leaf)
        if (param.shape, param.dtype) != (data.shape, data.dtype):
            raise ValueError(f"{name}.{leaf}: the {module.quant_method.fp8_backend} kernel "
                             f"holds {tuple(param.shape)} {param.dtype}, its format of the "
                             f"sync's weights is {tuple(data.shape)} {data.dtype}")
        param.data.copy_(data)
    return computed


def vllm_block_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own block-wise FP8 of a weight, as its online block methods do at load: a
    linear's `[out, in]`, or a stacked expert tensor expert by expert. (FP8 weight, fp32
    scales)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8  # lazy: vllm

    if weight.dim() == 2:
        return per_block_cast_to_fp8(weight, block_size=[128, 128], use_ue8m0=False)
    pairs = [per_block_cast_to_fp8(e, block_size=[128, 128], use_ue8m0=False) for e in weight]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _put(module: nn.Module, leaf: str, data: torch.Tensor) -> None:
    """The unpacked `data` into `module.<leaf>`: copied into the loaded parameter's storage
    when that still has the unpacked shape (GPU: CUDA graphs captured its address, so a new
    parameter would be invisible to them), else — the CPU kernel prepacked it into another
    shape — a fresh parameter with the loaded one's attributes (weight_loader etc.), which
    the repack below replaces anyway (no graphs on CPU)."""
    param = getattr(module, leaf)
    if (param.shape, param.dtype, param.device) == (data.shape, data.dtype, data.device):
        param.data.copy_(data)
        return
    fresh = nn.Parameter(data, requires_grad=False)
    for key, value in vars(param).items():
        if not key.startswith("_"):
            setattr(fresh, key, value)
    setattr(module, leaf, fresh)


__all__ = ["FP8_SCALES", "MoEInstaller", "fp8_scale_leaf", "is_fp8_experts", "is_fused_moe",
           "moe_logical_shape", "vllm_block_quantize"]
