"""Models: the HF-config reader (`ModelSpec`), presets, and the Megatron-Core GPT builder."""

from mcore_rl.models.spec import ModelSpec, UnsupportedModelError

__all__ = ["ModelSpec", "UnsupportedModelError"]
