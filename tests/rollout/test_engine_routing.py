"""An engine's routed experts (`RolloutEngine(routed_experts=True)`, R3) on a Qwen3-MoE model.

On GPU vLLM returns them; the CPU twin feeds the same path — vLLM's own outputs, given the rows
an HF forward of the engine's weights routes each position to, from the
`routed_experts_prompt_start` the engine asked for — so everything but vLLM's capture runs on
CPU: the request's start, the rows' conversion and checks, a partial rollout joining chunks
generated on two weight versions (each position keeps the routing of the version that forwarded
it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore_rl.layouts import materialize_rank, vllm_shards
from mcore_rl.models.hf_factory import make_hf_model_dir
from mcore_rl.models.presets import get_preset
from mcore_rl.rollout import RolloutConfig, RolloutEngine, SamplingConfig
from mcore_rl.rollout.partial import PartialBatch, advance

from gpu_twins import vllm_gpu_marks
from .helpers import MAX_MODEL_LEN, hf_state, prompts
from tests.support.moe_routing import hf_routing

MOE = get_preset("micro").with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                                qk_norm=True, rope_theta=1e6, norm_eps=1e-6, num_experts=4,
                                moe_ffn=64, experts_per_token=2, norm_topk_prob=False)


def returning_hf_routing(engine: RolloutEngine, model) -> None:
    """The twin: vLLM's outputs carry `model`'s routing as vLLM's capture returns it (uint8
    rows from the request's start, all but the last sampled token)."""
    generate = engine.llm.generate

    def with_routing(requests, params, **kwargs):
        outs = generate(requests, params, **kwargs)
        for request, p, out in zip(requests, params, outs):
            for c in out.outputs:
                seq = list(request["prompt_token_ids"]) + list(c.token_ids)
                rows = hf_routing(model, seq[:-1])[p.routed_experts_prompt_start:]
                c.routed_experts = rows.numpy().astype(np.uint8)
        return outs

    engine.llm.generate = with_routing
    engine.routed_experts = True


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_hf_model_dir(MOE, tmp_path_factory.mktemp("moe"), seed=0)


@pytest.fixture(scope="module")
def engine(moe_dir):
    eng = RolloutEngine(moe_dir, RolloutConfig(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25,
                                               block_size=32), call_timeout_s=600.0)
    yield eng
    eng.shutdown()


def load_routers(model, state) -> None:
    """`state`'s router weights into HF's model (the rest never changes here)."""
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in state.items() if k.endswith("mlp.gate.weight")}, strict=False)
    assert not unexpected


def moved_routers(state, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 2.0 * torch.randn(v.shape, generator=gen) if k.endswith("mlp.gate.weight")
            else v for k, v in state.items()}


def test_partial_rollout_rows_are_each_forwarding_versions(engine, moe_dir):
    from mcore_rl.models.hf_reference import load_hf_model

    model = load_hf_model(moe_dir)
    returning_hf_routing(engine, model)
    versions = [hf_state(moe_dir), moved_routers(hf_state(moe_dir), seed=1)]
    batch = PartialBatch.start(prompts(3, 8, seed=5), SamplingConfig(max_tokens=9, n=2, seed=3))
    for version, max_tokens in ((0, 3), (1, None)):
        weights = versions[version]
        engine.install_tensors(materialize_rank(vllm_shards(MOE, 1), 0,
                                                weights.__getitem__).items())
        load_routers(model, weights)
        advance(batch, engine.generate, version=version, max_tokens=max_tokens,
                max_model_len=MAX_MODEL_LEN, token_budget=4096, engines=1)
    assert batch.done and batch.chunks == 2
    flipped = 0
    for prompt, group in zip(batch.prompt_ids, batch.completions()):
        for c in group:
            seq = prompt + list(c.token_ids)
            assert c.routing.dtype == torch.int16 and c.routing.shape == (len(seq) - 1, 4, 2)
            held = len(prompt) + 2  # chunk 0 forwarded the prompt and its first 2 tokens
            per_version = []
            for version in (0, 1):
                load_routers(model, versions[version])
                per_version.append(hf_routing(model, seq[:-1]).to(torch.int16))
            assert torch.equal(c.routing[:held], per_version[0][:held])
            assert torch.equal(c.routing[held:], per_version[1][held:])
            flipped += int((per_version[0][:held] != per_version[1][:held]).any(-1).sum())
    assert flipped > 0  # the versions route differently: the rows tell them apart


def test_rows_vllm_did_not_return_are_named(engine, moe_dir):
    from mcore_rl.models.hf_reference import load_hf_model

    returning_hf_routing(engine, load_hf_model(moe_dir))
    generate = engine.llm.generate

    def one_row_short(requests, params, **kwargs):
        outs = generate(requests, params, **kwargs)
        for out in outs:
            for c in out.outputs:
                c.routed_experts = c.routed_experts[1:]
        return outs

    engine.llm.generate = one_row_short
    with pytest.raises(RuntimeError, match=r"vLLM returned routed experts of shape \(10, 4, 2\) "
                                           r"for a completion that needs 11 positions"):
        engine.generate([list(range(5, 13))], SamplingConfig(max_tokens=4, seed=1))


@pytest.mark.parametrize("device", [pytest.param("cuda", id="cuda", marks=vllm_gpu_marks(
    "tests/rollout/test_engine_routing.py::test_partial_rollout_rows_are_each_forwarding_"
    "versions (HF's rows in vLLM's outputs)"))])
def test_gpu_engine_returns_the_experts_hf_routes_to(moe_dir, device):
    """vLLM's own capture (V2 model runner, fp32): each completion's rows are the experts HF
    routes its positions to, up to near-ties that GPU numerics may break the other way."""
    from mcore_rl.models.hf_reference import load_hf_model

    engine = RolloutEngine(moe_dir, RolloutConfig(max_model_len=MAX_MODEL_LEN,
                                                  gpu_memory_utilization=0.2),
                           call_timeout_s=600.0, device=device, routed_experts=True)
    try:
        batch = prompts(3, 8, seed=5)
        outs = engine.generate(batch, SamplingConfig(max_tokens=6, n=2, seed=3))
        continued = engine.generate([batch[0] + list(outs[0][0].token_ids)],
                                    SamplingConfig(max_tokens=3, seed=4),
                                    routing_start=[len(batch[0]) + 5])
    finally:
        engine.shutdown()
    model = load_hf_model(moe_dir)
    agree, total = 0, 0
    for prompt, group in zip(batch, outs):
        for c in group:
            seq = prompt + list(c.token_ids)
            assert c.routing.shape == (len(seq) - 1, 4, 2)
            hf = hf_routing(model, seq[:-1]).sort(-1).values
            agree += int((c.routing.long().sort(-1).values == hf).all(-1).sum())
            total += hf.shape[0] * hf.shape[1]
    assert agree >= 0.97 * total, (agree, total)
    (c,) = continued[0]
    assert c.routing.shape == (len(c.token_ids), 4, 2)  # from the start asked for
