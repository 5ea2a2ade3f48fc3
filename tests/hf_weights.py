"""Random HF-named weights for the model tests: norms near 1, everything else small, one draw
per tensor in the layout table's order — so a seed names the same weights in every test."""

from __future__ import annotations

import torch

from mcore_rl.layouts import hf_shards
from mcore_rl.models.spec import ModelSpec


def random_hf_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_shards(spec).hf_shapes.items():
        noise = torch.randn(shape, generator=gen)
        out[name] = 1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise
    return out
