"""The experts an HF Qwen3-MoE routes each position to: the reference the routing-replay tests
compare the actor's and the engines' routing with."""

from __future__ import annotations

import torch


def hf_routing(model, seq: list[int]) -> torch.Tensor:
    """The experts `model` routes each position of `seq` to: [len(seq), layers, top-k]."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda module, args, out: chosen.append(out[2].reshape(len(seq), -1)))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(chosen, dim=1)
