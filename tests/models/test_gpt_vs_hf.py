"""Megatron-Core GPT built from a ModelSpec computes HF transformers' logits on the same weights.

HF weights go in through mcore_rl.layouts at TP2 (so q/k/v interleaving, q/k/v-bias and vocab
sharding are exercised too). Variants: Llama with GQA, Qwen2 (q/k/v bias), Qwen2 with tied
embeddings, Llama with llama3 rope scaling. One spawned launch for all of them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_weights import random_hf_weights
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.presets import get_preset
from mcore_rl.models.spec import ModelSpec, UnsupportedModelError

MICRO = get_preset("micro")
QWEN2 = MICRO.with_(family="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True,
                    rope_theta=1e6, norm_eps=1e-6)
VARIANTS = {
    "llama_gqa": MICRO,
    "qwen2_qkv_bias": QWEN2,
    "qwen2_tied": QWEN2.with_(tied_embeddings=True),
    # Scaling changes these logits by ~2e-3 here: the 1e-4 check would catch it being ignored.
    "llama3_rope_scaling": MICRO.with_(rope_theta=500000.0, max_positions=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
}
TP = 2
TOKENS = torch.randint(0, MICRO.vocab, (2, 24), generator=torch.Generator().manual_seed(3))


def _hf_reference(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    from mcore_rl.models.hf_factory import hf_config_from_spec

    model = AutoModelForCausalLM.from_config(hf_config_from_spec(spec), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if spec.tied_embeddings else [])
    with torch.no_grad():
        return model(TOKENS).logits.numpy()


def _megatron_logits(rank, world, cases):
    """Per variant: (full logits, log p(next token) with and without masking the padded vocab)
    from a TP2 megatron model holding the HF weights."""
    from megatron.core import tensor_parallel

    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.models.gpt import build_gpt_model, load_chunks
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import init_training_groups
    from mcore_rl.megatron.train import token_logprobs

    parallel = ParallelConfig(tp=world)
    groups = init_training_groups(parallel)
    out = {}
    for name, (spec, weights) in cases.items():
        chunks = build_gpt_model(spec, parallel, groups)
        shards = materialize_rank(megatron_shards(spec, parallel), rank,
                                  lambda n: torch.from_numpy(weights[n]))
        load_chunks(chunks, shards, None)
        positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
        with torch.no_grad():
            local = chunks[0](TOKENS, positions, None)  # [b, s, V_pad / tp]
            full = tensor_parallel.gather_from_tensor_model_parallel_region(local)
            labels = TOKENS.roll(-1, dims=1)
            masked = token_logprobs(local, labels, spec.vocab, rank)
            unmasked = -tensor_parallel.vocab_parallel_cross_entropy(local.clone(), labels)
        out[name] = (full[..., :spec.vocab].numpy(), masked.numpy(), unmasked.numpy(),
                     float(full[..., spec.vocab:].abs().max()))
    out["load_errors"] = _strict_load_errors(VARIANTS["llama_gqa"], parallel, groups, rank)
    spec = VARIANTS["llama3_rope_scaling"]
    try:
        build_gpt_model(spec.with_(rope_scaling={**spec.rope_scaling,
                                                 "original_max_position_embeddings": 4096}),
                        parallel, groups)
        out["refused_rope"] = ""
    except UnsupportedModelError as err:
        out["refused_rope"] = str(err)
    return out


def _strict_load_errors(spec, parallel, groups, rank) -> list[str]:
    """load_chunks with one tensor missing, then one extra: both must fail, naming the key."""
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.models.gpt import build_gpt_model, load_chunks

    chunks = build_gpt_model(spec, parallel, groups)
    full = materialize_rank(megatron_shards(spec, parallel), rank,
                            lambda n: torch.zeros(megatron_shards(spec, parallel).hf_shapes[n]))
    errors = []
    for state in ({k: v for k, v in full.items() if "linear_fc2" not in k},
                  {**full, "decoder.layers.0.mlp.extra.weight": torch.zeros(1)}):
        try:
            load_chunks(chunks, state, None)
            errors.append("")
        except RuntimeError as err:
            errors.append(str(err))
    return errors


@pytest.fixture(scope="module")
def compared():
    weights = {name: random_hf_weights(spec, seed=i) for i, (name, spec)
               in enumerate(VARIANTS.items())}
    cases = {name: (spec, {k: v.numpy() for k, v in weights[name].items()})
             for name, spec in VARIANTS.items()}
    megatron = run_on_ranks(_megatron_logits, TP, cases, timeout_s=240)
    return {name: (_hf_reference(spec, weights[name]), megatron)
            for name, spec in VARIANTS.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf(compared, variant):
    hf, ranks = compared[variant]
    for out in ranks:  # both TP ranks gather the same full logits
        logits, _, _, padded_max = out[variant]
        np.testing.assert_allclose(logits, hf, rtol=0, atol=1e-4)
        assert padded_max == 0.0  # megatron's padded vocab rows are zero weights


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_token_logprobs_ignore_padded_vocab(compared, variant):
    hf, ranks = compared[variant]
    logp = torch.log_softmax(torch.from_numpy(hf), dim=-1)
    want = logp.gather(-1, TOKENS.roll(-1, dims=1).unsqueeze(-1)).squeeze(-1).numpy()
    for out in ranks:
        _, masked, unmasked, _ = out[variant]
        np.testing.assert_allclose(masked, want, rtol=0, atol=1e-4)
        # megatron's own cross entropy spreads probability onto the 6 padded ids (logit 0).
        assert np.abs(unmasked - want).max() > 1e-3


def test_rope_scaling_megatron_cannot_reproduce_is_refused(compared):
    # megatron-core fixes low/high_freq_factor and original_max_position_embeddings.
    _, ranks = compared["llama3_rope_scaling"]
    assert "original_max_position_embeddings=4096" in ranks[0]["refused_rope"]


def test_load_is_strict(compared):
    _, ranks = compared["llama_gqa"]
    missing, unexpected = ranks[0]["load_errors"]
    assert "decoder.layers.0.mlp.linear_fc2.weight" in missing
    assert "decoder.layers.0.mlp.extra.weight" in unexpected
