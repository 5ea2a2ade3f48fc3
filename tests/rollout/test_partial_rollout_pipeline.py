"""Partial rollouts' schedule and bookkeeping without engines: a fake engine whose tokens and
log-probs are a function of (prefix, seed, weight version) records which version produced each
token; the loop syncs (version + 1) after each step as the controller does. The real-engine
checks (log-probs equal vLLM's under each token's version) are in
tests/rollout/test_partial.py and tests/rl/test_off_policy.py."""

import io
import random

import pytest
import torch

from mcore_rl.config import ConfigError, load_config
from mcore_rl.rollout.engine import Completion, SamplingConfig
from mcore_rl.rollout.partial import PartialBatch, advance
from mcore_rl.launch.timing import PhaseTimer
from mcore_rl.rollout.partial import PartialRolloutPipeline
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

EOS, CAP, N = 0, 7, 2


class FakeEngine:
    """Token t of a sample: drawn from Random((seed, prefix)) — EOS with probability 1/12;
    its log-prob encodes the version the engine holds: -(version + 1)."""

    def __init__(self, engines: int = 1):
        self.version, self.calls, self.engines = 0, [], engines

    def generate(self, prompts, sampling: SamplingConfig):
        self.calls.append((len(prompts), sampling.n, sampling.max_tokens, sampling.seed))
        out = []
        for i, prompt in enumerate(prompts):
            group = []
            for j in range(sampling.n):
                seed = sampling.sample_seed(i, j)
                ids = []
                for _ in range(sampling.max_tokens):
                    tok = random.Random(f"{seed}/{prompt + ids}").randrange(12)
                    ids.append(tok)
                    if tok == EOS:
                        break
                group.append(Completion(tuple(ids), tuple(-(self.version + 1.0) for _ in ids),
                                        "stop" if ids[-1] == EOS else "length"))
            out.append(group)
        return out


class Example:
    def __init__(self, step):
        self.step = step


class Result:
    def __init__(self, step, batch):
        self.step, self.batch = step, batch


def make_pipeline(engine, k, last=6, budget=4096):
    sampling = SamplingConfig(max_tokens=CAP, n=3, seed=11, stop_token_ids=(EOS,))

    def start(step):
        prompts = [[step, i + 1, 5] for i in range(4)]
        return Example(step), PartialBatch.start(prompts, SamplingConfig(
            **{**sampling.__dict__, "seed": 1000 + step}))

    def advance_on(batch, version, max_tokens):
        assert version == engine.version, "the schedule's version is the engines'"
        advance(batch, engine.generate, version=version, max_tokens=max_tokens,
                max_model_len=64, token_budget=budget, engines=engine.engines)

    def finish(step, examples, batch, timer):
        assert batch.done and examples.step == step
        return Result(step, batch)

    return PartialRolloutPipeline(
        start=start, advance=advance_on, finish=finish, chunk_tokens=N, max_staleness=k,
        last_step=last, wait=lambda f: f.result(timeout=30),
        examples_to_state=lambda e: e.step, examples_from_state=Example)


def run_steps(p, engine, steps):
    out = {}
    for step in steps:
        result, metrics = p.take(step, PhaseTimer())
        assert result.step == step
        out[step] = (result.batch.completions(), metrics)
        p.quiesce(PhaseTimer(), (0.0, 1.0))
        engine.version += 1  # the weight sync after step's update
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_token_records_its_version_and_staleness_is_bounded(k):
    engine = FakeEngine()
    out = run_steps(make_pipeline(engine, k), engine, range(1, 7))
    for step, (groups, metrics) in out.items():
        trained_at, first = step - 1, max(0, step - 1 - k)
        ages = []
        for c in (c for group in groups for c in group):
            assert len(c.versions) == len(c.token_ids) == len(c.logprobs)
            # the log-prob is the one the engine gave under the token's recorded version
            assert all(lp == -(v + 1.0) for lp, v in zip(c.logprobs, c.versions))
            # one chunk of N tokens per version from the batch's start, the rest at the end
            for t, v in enumerate(c.versions):
                assert v == min(first + t // N, trained_at), (step, c)
            assert c.finish_reason == "stop" or len(c.token_ids) == CAP
            ages += [trained_at - v for v in c.versions]
        assert metrics["staleness/max"] == max(ages) <= k
        assert metrics["staleness/mean"] == pytest.approx(sum(ages) / len(ages))
        assert metrics["staleness/dropped"] == 0
    # with k >= 1 the batches ahead really span versions
    assert out[6][1]["staleness/max"] == min(5, k) and out[6][1]["staleness/mean"] < k


def test_resume_continues_the_partial_generations_exactly():
    full_engine = FakeEngine()
    full = run_steps(make_pipeline(full_engine, 2), full_engine, range(1, 7))

    engine = FakeEngine()
    first = make_pipeline(engine, 2)
    run_steps(first, engine, range(1, 4))
    buffer = io.BytesIO()
    torch.save(first.state(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    # the buffer after step 3 holds batches 4 and 5 unfinished, begun on versions 1 and 2
    assert [(b["step"], b["version"]) for b in saved["partial"]] == [(4, 1), (5, 2)]
    assert all(b["batch"]["chunks"] >= 1 for b in saved["partial"])

    resumed_engine = FakeEngine()
    resumed_engine.version = 3
    resumed = make_pipeline(resumed_engine, 2)
    resumed.load_state(saved)
    out = run_steps(resumed, resumed_engine, range(4, 7))
    for step in (4, 5, 6):
        assert out[step][0] == full[step][0], step
        assert out[step][1]["staleness/max"] == full[step][1]["staleness/max"]


def test_resume_with_a_smaller_bound_drops_the_stale_batch():
    engine = FakeEngine()
    first = make_pipeline(engine, 3)
    run_steps(first, engine, range(1, 3))
    resumed = make_pipeline(engine, 1)
    resumed.load_state(first.state())  # batches 3..5 begun on versions 0, 0, 1
    out = run_steps(resumed, engine, (3, 4))
    for step in (3, 4):  # both begun on version 0, now 2 and 3 behind
        assert out[step][1]["staleness/dropped"] == 1 and out[step][1]["staleness/max"] == 0


def test_continuations_fit_the_token_budget_with_seeds_independent_of_the_cut():
    """A continuation call's prefill must fit max_num_batched_tokens per engine (vLLM CPU fails
    a seeded prefill split over steps); cutting the calls must not change any sample."""
    def generate(budget, engines):
        engine = FakeEngine(engines)
        batch = PartialBatch.start([[1, 2, 3, i] for i in range(6)],
                                   SamplingConfig(max_tokens=CAP, n=4, seed=5,
                                                  stop_token_ids=(EOS,)))
        while not batch.done:
            advance(batch, engine.generate, version=engine.version, max_tokens=N,
                    max_model_len=64, token_budget=budget, engines=engines)
            engine.version += 1
        return batch, engine.calls

    whole, whole_calls = generate(4096, 1)
    cut, cut_calls = generate(11, 2)  # 6..10-token prefixes: one per engine per call
    assert cut.completions() == whole.completions()
    assert len(cut_calls) > len(whole_calls)
    chunk_seeds = {seed for _, _, _, seed in cut_calls[1:]}
    for count, n, _, seed in cut_calls[1:]:
        assert n == 1 and count <= 2 and seed != 5
    # every chunk is a call seeded on its own, whichever part of it a call carries
    assert len(chunk_seeds) == cut.chunks - 1


def test_partial_rollout_config_errors():
    base = ["warmup.max_steps=0"]
    with pytest.raises(ConfigError, match=r"partial_chunk_tokens=0: must be >= 1"):
        load_config(RLConfig, DEMO_SIZED, base + ["rollout.mode=async",
                                            "rollout.partial_chunk_tokens=0"])
    with pytest.raises(ConfigError, match=r"partial_chunk_tokens=-2"):
        load_config(RLConfig, DEMO_SIZED, base + ["rollout.mode=async",
                                            "rollout.partial_chunk_tokens=-2"])
    with pytest.raises(ConfigError, match=r"partial_chunk_tokens=2: .*mode=sync"):
        load_config(RLConfig, DEMO_SIZED, base + ["rollout.partial_chunk_tokens=2"])
    with pytest.raises(ConfigError, match=r"rollout.partial_chunk_tokens=2: .*multi-turn "
                                          r"\(task.multi_turn\)"):
        load_config(RLConfig, DEMO_SIZED, base + ["rollout.mode=async", "rollout.partial_chunk_tokens=2",
                                            "task.kind=tool_calc"])
    with pytest.raises(ConfigError, match=r"rollout.partial_chunk_tokens=2: .*"
                                          r"algorithm.dynamic_sampling"):
        load_config(RLConfig, DEMO_SIZED, base + ["rollout.mode=one_step",
                                            "rollout.partial_chunk_tokens=2",
                                            "algorithm.dynamic_sampling=true"])
    cfg = load_config(RLConfig, DEMO_SIZED, base + ["rollout.mode=async",
                                              "rollout.partial_chunk_tokens=2"])
    assert cfg.rollout.partial_chunk_tokens == 2
