"""MoE routing replay on a Megatron Qwen3-MoE (megatron/routing_replay.py): a forward records
each token's experts; after the router weights move, a forward that replays the recording
gives HF's logits computed with those experts forced (and differs from the free forward, whose
routing flipped); the flips are counted. Both of megatron's softmax orders (HF's
norm_topk_prob false and true)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_weights import random_hf_weights
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.presets import get_preset

MICRO = get_preset("micro")
QWEN3_MOE = MICRO.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                        rope_theta=1e6, norm_eps=1e-6, num_experts=4, moe_ffn=64,
                        experts_per_token=2, norm_topk_prob=False)
TOKENS = torch.randint(0, MICRO.vocab, (2, 24), generator=torch.Generator().manual_seed(3))


def perturbed_routers(weights: dict[str, torch.Tensor], scale: float = 0.5):
    gen = torch.Generator().manual_seed(7)
    return {k: v + scale * torch.randn(v.shape, generator=gen) if k.endswith("mlp.gate.weight")
            else v for k, v in weights.items()}


def _megatron_runs(rank, world, spec, weights, moved):
    """Record on `weights`; then on `moved` (the routers perturbed): the free forward, its
    routing, and the forward replaying the first recording. Routing per row [b, s, L, k]."""
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.megatron import routing_replay as rr
    from mcore_rl.megatron.train import MicroBatch, forward_logits
    from mcore_rl.models.gpt import build_gpt_model, load_chunks
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import init_training_groups

    parallel = ParallelConfig()
    groups = init_training_groups(parallel)
    (chunk,) = build_gpt_model(spec, parallel, groups)
    chunk.eval()
    rr.install_replay([chunk])
    batch = MicroBatch(tokens=TOKENS, labels=TOKENS, loss_mask=torch.ones(TOKENS.shape))

    def forward(state):
        load_chunks([chunk], materialize_rank(megatron_shards(spec, parallel), rank,
                                              lambda n: torch.from_numpy(state[n])), None)
        return forward_logits([chunk], [batch], vocab=spec.vocab, groups=groups)[0]

    with rr.recording(chunk):
        forward(weights)
    old = rr.recorded(chunk)
    with rr.recording(chunk):
        free = forward(moved)
    fresh = rr.recorded(chunk)
    with rr.replaying(chunk, old):
        replayed = forward(moved)
    first_layer_flips = chunk.decoder.layers[0].mlp.router.router_replay.flips
    flips, tokens = rr.flip_counts([chunk])
    b = TOKENS.shape[0]
    return {"old": rr.row_order(old, b).numpy(), "fresh": rr.row_order(fresh, b).numpy(),
            "free": free.numpy(), "replayed": replayed.numpy(), "flips": flips,
            "tokens": tokens, "first_layer_flips": first_layer_flips}


def _hf_logits(spec, weights, tmp, forced: np.ndarray | None = None) -> np.ndarray:
    """HF's logits; `forced` [b, s, L, k]: every layer's router takes those experts (its
    softmax still computed from its own logits)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from mcore_rl.models.hf_factory import hf_config_from_spec

    hf_config_from_spec(spec).save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
    if forced is not None:
        for index, layer in enumerate(model.model.layers):
            layer.mlp.gate.forward = _forced_router(layer.mlp.gate, forced[:, :, index])
    with torch.no_grad():
        return model(TOKENS).logits.numpy()


def _forced_router(gate, experts: np.ndarray):
    chosen = torch.from_numpy(experts).reshape(-1, experts.shape[-1]).long()  # batch-major

    def forward(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.weight.shape[1]),
                                            gate.weight)
        top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
        if gate.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), chosen

    return forward


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_replayed_routing_gives_hf_logits_with_the_recorded_experts(tmp_path, norm_topk_prob):
    spec = QWEN3_MOE.with_(norm_topk_prob=norm_topk_prob)
    weights = random_hf_weights(spec, seed=11)
    moved = perturbed_routers(weights)
    (run,) = run_on_ranks(_megatron_runs, 1, spec, {k: v.numpy() for k, v in weights.items()},
                          {k: v.numpy() for k, v in moved.items()}, timeout_s=300)
    # the recorded routing is HF's on the original weights, the fresh one HF's on the moved
    hf_old = _hf_logits(spec, weights, tmp_path / "old", forced=run["old"])
    np.testing.assert_allclose(hf_old, _hf_logits(spec, weights, tmp_path / "base"), atol=1e-5)
    differs = (np.sort(run["old"], -1) != np.sort(run["fresh"], -1)).any(-1)
    assert differs.any()  # moving the routers flipped some tokens' experts
    # the replaying forward counts the tokens whose own choice differs from the replayed one:
    # at the first layer (same input as the free forward) exactly those that flipped; later
    # layers see the replayed layers' outputs
    assert run["first_layer_flips"] == int(differs[:, :, 0].sum()) > 0
    assert run["tokens"] == differs.size and 0 < run["flips"] <= differs.size
    np.testing.assert_allclose(run["free"], _hf_logits(spec, moved, tmp_path / "free"),
                               atol=1e-4)
    np.testing.assert_allclose(run["replayed"],
                               _hf_logits(spec, moved, tmp_path / "forced", forced=run["old"]),
                               atol=1e-4)
    assert np.abs(run["replayed"] - run["free"]).max() > 1e-3


def test_token_orders_round_trip():
    from mcore_rl.megatron.routing_replay import router_order, row_order

    rows = torch.arange(2 * 5 * 3 * 2).reshape(2, 5, 3, 2)
    tokens = router_order(rows)
    assert tokens.shape == (3, 10, 2)
    assert torch.equal(tokens[1, 1], rows[1, 0, 1])  # sequence-major: token (s=0, b=1)
    assert torch.equal(row_order(tokens, 2), rows)
