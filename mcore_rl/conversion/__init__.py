"""Checkpoints: HF safetensors ↔ megatron-core dist checkpoints, streamed tensor by tensor.

`hf_to_mcore` / `mcore_to_hf` convert (one process or a rank's share under torchrun/srun);
`verify_conversion` compares HF transformers and Megatron logits. `checkpoint_layout` is the
grid-independent checkpoint form, derived from `mcore_rl.layouts`. CLI: `mcore-rl convert`.
"""

from importlib import import_module

# name → module: imported on first use, so that a process needing only a light part of the
# package (the RL driver's checkpoint bookkeeping imports `checkpoint.output`) does not pay for
# torch.distributed.checkpoint and megatron (a noticeable part of the driver's start-up)
_LAZY = {
    "ConvertReport": "convert", "hf_to_mcore": "convert", "mcore_to_hf": "convert",
    "ConversionError": "errors",
    "CkptLayout": "layout", "CkptTensor": "layout", "checkpoint_layout": "layout",
    "VerifyReport": "verify", "verify_conversion": "verify",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
