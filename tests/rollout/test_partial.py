"""Partial rollouts on a real vLLM engine (TP=1, in-process): a batch generated in chunks with
new weights installed between chunks records, per token, the version that produced it and a
log-prob equal to what vLLM gives that token under that version's weights (re-scored with
`prompt_logprobs` on an engine holding each version in turn)."""

from __future__ import annotations

import pytest

from mcore_rl.rollout import RolloutConfig, RolloutEngine, SamplingConfig
from mcore_rl.rollout.partial import PartialBatch, advance

from .helpers import MAX_MODEL_LEN, hf_state, perturbed, prompts, rank_items

CHUNK = 3


@pytest.fixture(scope="module")
def engine(micro_dir):
    eng = RolloutEngine(micro_dir, RolloutConfig(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25,
                                                 block_size=32),
                        call_timeout_s=600.0)
    yield eng
    eng.shutdown()


def rescore(engine, sequences: list[list[int]]) -> list[list[float]]:
    """vLLM's raw log-prob of every token after the first of each sequence (prompt_logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params,
                               use_tqdm=False)
    return [[float(pos[tok].logprob) for pos, tok in zip(out.prompt_logprobs[1:], seq[1:])]
            for out, seq in zip(outs, sequences)]


def test_partial_rollout_logprobs_are_each_versions(engine, micro_dir):
    w0 = hf_state(micro_dir)
    weights = [w0, perturbed(w0, seed=1), perturbed(w0, seed=2)]
    batch = PartialBatch.start(prompts(3, 8, seed=5), SamplingConfig(max_tokens=9, n=2, seed=3))
    # chunk on version 0, sync, chunk on version 1, sync, the rest on version 2
    for version, max_tokens in ((0, CHUNK), (1, CHUNK), (2, None)):
        engine.install_tensors(rank_items(weights[version], tp=1, rank=0))
        advance(batch, engine.generate, version=version, max_tokens=max_tokens,
                max_model_len=MAX_MODEL_LEN, token_budget=4096, engines=1)
    assert batch.done and batch.chunks == 3
    samples = [(p, c) for p, group in zip(batch.prompt_ids, batch.completions()) for c in group]
    for _, c in samples:  # micro has no EOS: every sample runs to the cap
        assert c.versions == (0,) * 3 + (1,) * 3 + (2,) * 3 and len(c.logprobs) == 9

    sequences = [p + list(c.token_ids) for p, c in samples]
    worst_own, best_other = 0.0, float("inf")
    for version, w in enumerate(weights):
        engine.install_tensors(rank_items(w, tp=1, rank=0))
        for (p, c), scored in zip(samples, rescore(engine, sequences)):
            response = scored[len(p) - 1:]  # log-probs of the response tokens
            for lp, v, ref in zip(c.logprobs, c.versions, response):
                if v == version:
                    worst_own = max(worst_own, abs(lp - ref))
                else:
                    best_other = min(best_other, abs(lp - ref))
    print(f"own version max |Δ| {worst_own:.2e}, other versions min |Δ| {best_other:.2e}")
    assert worst_own < 1e-4, worst_own
    assert best_other > 1e-3, best_other  # the check tells versions apart
    engine.install_tensors(rank_items(w0, tp=1, rank=0))
