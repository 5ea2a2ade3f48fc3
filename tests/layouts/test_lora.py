"""Adapter layouts derived from the weights' (mcore_rl/layouts/lora.py): B follows W's rows,
A W's columns, on any side and grid; assembled from every rank they give PEFT's tensors whole,
and ΔW = scale·B·A built per rank from them is the rank's shard of the HF ΔW."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.layouts import assemble_hf, materialize_rank, megatron_shards, vllm_shards
from mcore_rl.layouts.lora import adapted_weights, lora_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

SPEC = get_preset("micro")
R = 4
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")


def _hf_adapters(adapters) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in
            sorted(adapters.hf_shapes.items())}


@pytest.mark.parametrize("grid", [ParallelConfig(), ParallelConfig(tp=2, pp=2),
                                  ParallelConfig(tp=2, pp=2, vpp=2)],
                         ids=["tp1", "tp2pp2", "tp2pp2vpp2"])
def test_megatron_adapter_shards_round_trip_and_hold_the_shard_of_delta_w(grid):
    weights = megatron_shards(SPEC, grid)
    adapters = lora_shards(weights, R, TARGETS)
    # a stage's 4 linears per layer (names local to the stage) and the last one's output layer
    assert len(adapted_weights(weights, TARGETS)) == 4 * SPEC.layers // grid.pp + 1
    # PEFT's names: one A and one B per adapted HF weight (q, k, v share the side's one A);
    # lm_head's B has the vocabulary's rows (the output layer's padding rows map to none)
    assert sorted(adapters.hf_shapes)[2:4] == ["model.layers.0.mlp.down_proj.lora_A.weight",
                                               "model.layers.0.mlp.down_proj.lora_B.weight"]
    assert adapters.hf_shapes["lm_head.lora_A.weight"] == (R, SPEC.hidden)
    assert adapters.hf_shapes["lm_head.lora_B.weight"] == (SPEC.vocab, R)
    assert len(adapters.hf_shapes) == 2 * 7 * SPEC.layers + 2
    hf = _hf_adapters(adapters)
    # q, k, v (gate, up) of a layer must share A for a fused weight: make them equal
    for layer in range(SPEC.layers):
        for parts in (("q", "k", "v"), ("gate", "up")):
            block = "self_attn" if parts[0] == "q" else "mlp"
            names = [f"model.layers.{layer}.{block}.{p}_proj.lora_A.weight" for p in parts]
            for n in names[1:]:
                hf[n] = hf[names[0]]
    local = {r: materialize_rank(adapters, r, hf.__getitem__) for r in adapters.ranks}
    back = assemble_hf(adapters, local)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    # ΔW per rank = B_local · A_local is that rank's shard of the HF ΔWs, laid out as W
    delta_hf = {n.replace(".lora_B", ""): hf[n] @ hf[n.replace("lora_B", "lora_A")]
                for n in hf if ".lora_B." in n}
    for r in weights.ranks:
        expected = materialize_rank(
            weights, r, lambda n: delta_hf[n] if n in delta_hf else torch.zeros(
                weights.hf_shapes[n]))
        for key in adapted_weights(weights, TARGETS):
            if key not in weights.ranks[r]:
                continue
            module = key.removesuffix(".weight")
            delta = local[r][f"{module}.lora.lora_b"] @ local[r][f"{module}.lora.lora_a"]
            torch.testing.assert_close(delta, expected[key], rtol=1e-5, atol=1e-6)


def test_vllm_adapter_shards_follow_vllm_layouts():
    """The same derivation on vLLM's side (TP2): qkv_proj's B rows are [q_r; k_r; v_r]."""
    weights = vllm_shards(SPEC, 2)
    adapters = lora_shards(weights, R, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    b = adapters.ranks[1]["model.layers.0.self_attn.qkv_proj.lora.lora_b"]
    assert [p.hf_name.split(".")[-3] for p in b.pieces] == ["q_proj", "k_proj", "v_proj"]
    assert b.shape == (SPEC.heads * SPEC.head_dim // 2 + SPEC.kv_heads * SPEC.head_dim, R)


def test_rank_below_one_is_refused():
    with pytest.raises(ValueError, match="lora rank=0: must be >= 1"):
        lora_shards(megatron_shards(SPEC, ParallelConfig()), 0, TARGETS)
