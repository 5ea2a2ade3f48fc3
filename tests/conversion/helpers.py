"""Shared specs and helpers of the checkpoint-conversion tests."""

from __future__ import annotations

from pathlib import Path

import torch

from mcore_rl.models.presets import get_preset

MICRO = get_preset("micro")  # 4 layers, hidden 128, 4 heads / 2 kv heads of 32, ffn 256

FAMILIES = {
    # Llama with GQA (2 query heads per kv head).
    "llama_gqa": MICRO,
    # Mistral-style: Mistral class, 8 heads / 4 kv heads, head_dim 32 != hidden / heads; kv 4
    # lets it load at TP4, 4 layers at PP4.
    "mistral": MICRO.with_(architecture="MistralForCausalLM", heads=8, kv_heads=4, head_dim=32),
    # Qwen2: q/k/v biases, tied embeddings.
    "qwen2_tied_bias": MICRO.with_(family="qwen2", architecture="Qwen2ForCausalLM",
                                   qkv_bias=True, tied_embeddings=True, rope_theta=1e6,
                                   norm_eps=1e-6),
    # Qwen3: q/k norms ([head_dim] per layer, stacked like every layer tensor), head_dim 48.
    "qwen3": MICRO.with_(family="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True,
                         head_dim=48, rope_theta=1e6, norm_eps=1e-6),
    # Qwen3-MoE: 4 experts (top 2, softmax over all experts) with their own ffn, a router per
    # layer; experts stacked on an expert axis in the checkpoint, the MLP norm under two keys.
    "qwen3_moe": MICRO.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                             qk_norm=True, head_dim=32, rope_theta=1e6, norm_eps=1e-6,
                             num_experts=4, moe_ffn=64, experts_per_token=2,
                             norm_topk_prob=False),
    # Mixtral: experts at block_sparse_moe (w1/w3/w2), one intermediate size.
    "mixtral": MICRO.with_(family="mixtral", architecture="MixtralForCausalLM", ffn=96,
                           num_experts=4, moe_ffn=96, experts_per_token=2),
}


def hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from mcore_rl.models.hf_weights import SafetensorsWeights

    w = SafetensorsWeights(model_dir)
    return {name: w.tensor(name) for name in w.names()}


def assert_bit_exact(a: Path, b: Path) -> int:
    ta, tb = hf_tensors(a), hf_tensors(b)
    assert ta.keys() == tb.keys(), (sorted(ta.keys() ^ tb.keys()))
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name
    return len(ta)


def write_random_hf_dir(spec, out: Path, *, max_shard_bytes: int, seed: int = 0) -> Path:
    """An HF folder of random weights, written one tensor at a time (no model in memory)."""
    from mcore_rl.conversion.safetensors_io import (create_files, plan_shards, write_index,
                                                    write_tensor)
    from mcore_rl.layouts import hf_shards
    from mcore_rl.models.hf_factory import hf_config_from_spec
    from mcore_rl.models.hf_weights import RandomWeights

    out.mkdir(parents=True)
    shapes = hf_shards(spec).hf_shapes
    weights = RandomWeights(shapes, seed=seed)
    plan = plan_shards([(n, s, torch.float32) for n, s in shapes.items()], max_shard_bytes)
    create_files(out, plan)
    write_index(out, plan)
    for name in shapes:
        write_tensor(out, plan.slots[name], weights[name])
    hf_config_from_spec(spec).save_pretrained(out)
    return out
