"""One in-process vLLM engine (TP=1, uni executor), shared by every test here: the generation
API, raw log-probs against HF transformers, installing per-rank shards (directly and through
the real sync group) and the prefix cache after a weight update."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore_rl.layouts import vllm_shards
from mcore_rl.models.hf_reference import greedy_generate, load_hf_model
from mcore_rl.rollout import (RolloutConfig, RolloutEngine, RolloutError, SamplingConfig,
                              install_from_iterator)

from .helpers import (MAX_MODEL_LEN, SPEC, Trainer, hf_model_with, hf_state, perturbed, prompts,
                      rank_items)

GREEDY = SamplingConfig(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def engine(micro_dir):
    # block_size 32: 40-token prompts fill a block, so the prefix cache really holds them.
    eng = RolloutEngine(micro_dir, RolloutConfig(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25,
                                                 block_size=32),
                        call_timeout_s=600.0)
    print(f"TP=1 in-process start-up: {eng.startup_s:.1f} s")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(micro_dir):
    return load_hf_model(micro_dir)


def tokens(results):
    return [[list(c.token_ids) for c in samples] for samples in results]


def assert_same(a, b, atol=1e-5):
    """Same tokens and finish reasons; log-probs equal up to batching round-off."""
    assert tokens(a) == tokens(b)
    for sa, sb in zip(a, b):
        for ca, cb in zip(sa, sb):
            assert ca.finish_reason == cb.finish_reason
            assert torch.allclose(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs),
                                  atol=atol, rtol=0)


def test_generation_api_shapes_order_n_and_seeds(engine):
    ps = prompts(5, 8)
    sp = SamplingConfig(max_tokens=12, n=3, seed=7)
    out = engine.generate(ps, sp)
    assert len(out) == 5 and all(len(samples) == 3 for samples in out)
    for samples in out:
        for c in samples:
            assert 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == "length"  # micro has no EOS; 12 tokens each
            assert all(lp <= 0.0 for lp in c.logprobs)
    assert any(len({c.token_ids for c in samples}) > 1 for samples in out)  # a real group
    # Order: each prompt alone, at its global index, gives exactly its batch result.
    for i, p in enumerate(ps):
        assert_same(engine.generate([p], sp, first_index=i), [out[i]])
    assert_same(engine.generate(ps, sp), out)  # reproducible
    assert tokens(engine.generate(ps, replace(sp, seed=8))) != tokens(out)
    assert engine.generate([], sp) == []


def test_consecutive_steps_do_not_repeat_each_others_samples(engine):
    """The same prompts sampled as RL steps k and k+1 sample them (seeds by `step_sampling`):
    a sample of step k+1 equals one of step k no more often than two samples of one step
    do. (Seeds once added small integers: step k+1's sample j-1 was step k's sample j.)"""
    from mcore_rl.config import load_config
    from mcore_rl.rl.sampler import step_sampling
    from mcore_rl.runconfig import RLConfig

    cfg = load_config(RLConfig, None, ["samples_per_prompt=8", "max_new_tokens=6",
                                       "max_prompt_tokens=8", "rollout.max_model_len=64"])
    ps = prompts(8, 8)
    steps = [tokens(engine.generate(ps, step_sampling(cfg, k, 0, eos_id=0)))
             for k in (3, 4)]
    across = sum(a == b for g3, g4 in zip(*steps) for a in g3 for b in g4)
    within = sum(g[i] == g[j] for g in steps[0] for i in range(8) for j in range(i + 1, 8))
    print(f"identical pairs: {across} across steps, {within} within a step")
    assert within <= 2  # a near-uniform model: two samples rarely agree
    # 64 cross pairs per prompt vs 28 within: chance gives about 2.3x the within count
    assert across <= 2.3 * within + 2, (across, within)
    # and the old additive seeds would have repeated 7 of every 8 samples
    assert across < 8 * 7


def test_prompt_longer_than_the_model_is_refused(engine):
    with pytest.raises(RolloutError, match="prompt 3 has 300 tokens"):
        engine.generate([[5] * 300], GREEDY, first_index=3)


@pytest.mark.parametrize("sp", [
    SamplingConfig(max_tokens=16, n=2, seed=1),                                 # T=1
    SamplingConfig(max_tokens=16, n=2, seed=2, temperature=0.7, top_k=20, top_p=0.9),
], ids=["t1", "t0.7-topk-topp"])
def test_logprobs_are_raw_and_match_hf(engine, hf_model, sp):
    """vLLM's sampled-token log-probs = HF's log_softmax(logits) of the unmodified model,
    whatever the temperature / top-k / top-p (logprobs_mode="raw_logprobs")."""
    ps = prompts(3, 6, seed=1)
    out = engine.generate(ps, sp)
    worst_raw, worst_processed = 0.0, 0.0
    with torch.no_grad():
        for p, samples in zip(ps, out):
            for c in samples:
                ids = torch.tensor([p + list(c.token_ids)])
                logits = hf_model(input_ids=ids).logits[0, len(p) - 1:-1]
                picked = ids[0, len(p):, None]
                raw = torch.log_softmax(logits, -1).gather(-1, picked)[:, 0]
                scaled = torch.log_softmax(logits / sp.temperature, -1).gather(-1, picked)[:, 0]
                got = torch.tensor(c.logprobs)
                worst_raw = max(worst_raw, float((got - raw).abs().max()))
                worst_processed = max(worst_processed, float((got - scaled).abs().max()))
    assert worst_raw < 1e-4
    if sp.temperature != 1.0:
        assert worst_processed > 1e-2  # really the raw distribution, not the sampling one


def test_greedy_matches_hf_and_stop_tokens_end_responses(engine, hf_model):
    ps = prompts(4, 8, seed=2)
    out = engine.generate(ps, GREEDY)
    assert tokens(out) == [[g] for g in greedy_generate(hf_model, ps, max_new_tokens=10)]
    # Stop at the 4th greedy token of prompt 0: the response ends with it, reason "stop".
    first = list(out[0][0].token_ids)
    stop = first[3]
    cut = first[:first.index(stop) + 1]
    stopped = engine.generate(ps[:1], replace(GREEDY, stop_token_ids=(stop,)))[0][0]
    assert list(stopped.token_ids) == cut and stopped.finish_reason == "stop"


def test_install_per_rank_shards_and_prefix_cache_is_never_stale(engine, micro_dir):
    ps = prompts(4, 40, seed=3)  # > one 32-token block each: cached by the first call
    g0 = engine.generate(ps, GREEDY)  # engine as loaded from the folder
    w0 = hf_state(micro_dir)
    w1 = perturbed(w0, seed=1)
    hf_w1 = [[g] for g in greedy_generate(hf_model_with(micro_dir, w1), ps, max_new_tokens=10)]
    assert hf_w1 != tokens(g0)

    names = engine.install_tensors(rank_items(w1, tp=1, rank=0))
    assert names == sorted(vllm_shards(SPEC, 1).ranks[0])  # all 27 tensors
    # Same prompts, cached under w0: after the install's cache reset they must follow w1.
    assert tokens(engine.generate(ps, GREEDY)) == hf_w1

    engine.install_tensors(rank_items(w0, tp=1, rank=0))
    assert_same(engine.generate(ps, GREEDY), g0, atol=1e-6)  # = the engine loaded from disk

    # Control: the same install *without* the reset serves KV computed with the old weights.
    items = rank_items(w1, tp=1, rank=0)
    engine.llm.apply_model(lambda model: install_from_iterator(model, items))
    assert tokens(engine.generate(ps, GREEDY)) != hf_w1
    engine.reset_prefix_cache()
    assert tokens(engine.generate(ps, GREEDY)) == hf_w1
    engine.install_tensors(rank_items(w0, tp=1, rank=0))


def test_sync_group_in_process(engine, micro_dir):
    """TP=1 through the real path: sync group + plan + transport, trainer in this process."""
    ps = prompts(3, 40, seed=4)
    w0 = hf_state(micro_dir)
    w1 = perturbed(w0, seed=2)
    g0 = engine.generate(ps, GREEDY)
    trainer = Trainer(tp=1)
    engine.check_shapes([trainer.plan.dst_shapes[1]])
    trainer.connect(engine)
    report, stats = trainer.sync(engine, w1)
    assert set(report.ranks[0].names) == trainer.plan.expected_names(1)
    print(f"TP=1 sync: {report.as_dict()} trainer: {stats}")
    hf_w1 = greedy_generate(hf_model_with(micro_dir, w1), ps, max_new_tokens=10)
    assert tokens(engine.generate(ps, GREEDY)) == [[g] for g in hf_w1]
    trainer.sync(engine, w0)
    assert_same(engine.generate(ps, GREEDY), g0, atol=1e-6)
    trainer.disconnect(engine)


def test_worker_errors_come_back_as_named_replies(engine):
    with pytest.raises(RolloutError, match=r"tp rank 0, sync: .*model.norm.weight: got shape "
                                           r"\(3,\), this rank holds \(128,\)"):
        engine.install_tensors([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(RolloutError, match="no such module"):
        engine.install_tensors([("model.nope.weight", torch.zeros(3))])
    shapes = engine.describe_shards()[0]  # the engine still answers
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (256, 128)  # packed on CPU
    wrong = dict(shapes, **{"lm_head.weight": (250, 128)})
    with pytest.raises(RolloutError, match=r"lm_head.weight: vLLM \(256, 128\) vs plan"):
        engine.check_shapes([wrong])
    with pytest.raises(RolloutError, match="begin_sync before start_join_sync_group"):
        engine.begin_sync(None)
    # The worker's backend refuses a plan outside a sync group, and says so when asked.
    engine.llm.start_weight_update()
    engine.llm.update_weights({"update_info": {"plan": None}})
    engine.llm.finish_weight_update()
    with pytest.raises(RolloutError, match="RuntimeError: not in a sync group"):
        engine.call_workers("weight_transfer_outcome", "update", phase="sync")
