"""A rollout's routed experts travel with its samples (rollout/routing.py): joined over the turns
of an episode and the chunks of a partial rollout, each later call asking only for the positions
not held yet, cut with a cut turn, saved with a checkpoint, and placed on the batch's token
positions (-1 where there is none). The engines here are the scripted stand-ins of the
multi-turn and partial tests, wrapped to return rows as vLLM does; vLLM's own rows are checked
against HF in tests/rollout/test_engine_routing.py."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch

from mcore_rl.rollout.batches import Rollouts, build_batch
from mcore_rl.rollout.engine import Completion, SamplingConfig
from mcore_rl.rollout.partial import PartialBatch, advance
from mcore_rl.rollout.routing import batch_rows
from mcore_rl.tasks import tokenizer as tk
from mcore_rl.tasks.base import Example

from .test_multi_turn import EXAMPLES, Scripted, runner, tok, tool_user  # noqa: F401
from .test_partial_rollout_pipeline import EOS, FakeEngine

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

LAYERS, K = 3, 2


def expected_rows(seq: list[int]) -> torch.Tensor:
    """The routing a router would give position j of `seq`: a function of tokens 0..j only,
    [len(seq) - 1, layers, k] (the last token is never forwarded)."""
    rows = [[[(sum(seq[:j + 1]) + 3 * j + layer) % 7, (seq[j] + layer) % 5 + 7]
             for layer in range(LAYERS)] for j in range(len(seq) - 1)]
    return torch.tensor(rows, dtype=torch.int16).reshape(-1, LAYERS, K)


class Routed:
    """An engine stand-in whose completions carry routed experts as vLLM returns them: the
    positions from the call's routing_start to the last forwarded one. Records the starts."""

    def __init__(self, generate):
        self.inner, self.starts = generate, []

    def __call__(self, prompts, sampling, routing_start=None):
        starts = [0] * len(prompts) if routing_start is None else list(routing_start)
        self.starts.append(starts)
        outs = self.inner(prompts, sampling)
        return [[replace(c, routing=expected_rows(list(p) + list(c.token_ids))[start:])
                 for c in group] for p, start, group in zip(prompts, starts, outs)]


def held_rows_match(prompt, completion) -> int:
    """The rows `completion` holds are those of its sequence's positions; their count."""
    seq = list(prompt) + list(completion.token_ids)
    rows = completion.routing
    assert rows is not None and len(seq) - 1 <= rows.shape[0] <= len(seq)
    assert torch.equal(rows, expected_rows(seq + [0])[:rows.shape[0]])
    return rows.shape[0]


def test_episodes_join_each_turns_rows_asking_only_for_new_positions(tok):  # noqa: F811
    engine = Routed(Scripted(tok, tool_user, []))
    encode = lambda text: tk.encode_prompt(tok, text)  # noqa: E731
    sampling = SamplingConfig(n=2, max_tokens=16, seed=5, stop_token_ids=(tok.eos_token_id,))
    prompts, groups = runner(tok, max_turns=3, max_total_tokens=40).rollout(
        engine, EXAMPLES, encode, sampling)
    assert len(engine.starts) == 2 and engine.starts[0] == [0] * 6
    held = [held_rows_match(p, e) for p, group in zip(prompts, groups) for e in group]
    # turn 2 (the episodes that called the tool) asked from the end of turn 1's rows: the
    # prompt and the call, all but its last token
    callers = [e for group in groups for e in group if e.turns == 2]
    assert len(callers) == 4 and all(0 < s for s in engine.starts[1])
    assert held == [len(p) + len(e.token_ids) - 1 for p, g in zip(prompts, groups) for e in g]


def test_a_cut_turn_keeps_the_rows_of_the_positions_left(tok):  # noqa: F811
    engine = Routed(Scripted(tok, lambda text: "1<call>calc: 2*3</call>99"
                             if "<result>" not in text else "6</s>", []))
    prompts, groups = runner(tok, max_turns=3, max_total_tokens=60).rollout(
        engine, [Example("2*3=", "6")], lambda t: tk.encode_prompt(tok, t),
        SamplingConfig(max_tokens=30))
    episode = groups[0][0]
    call_end = episode.loss_mask.index(0)  # the first observation token
    # turn 1 was cut after its call; every position up to its last kept token has its row
    assert engine.starts[1] == [len(prompts[0]) + call_end]
    assert held_rows_match(prompts[0], episode) == len(prompts[0]) + len(episode.token_ids) - 1


def test_partial_samples_join_their_chunks_and_checkpoint_them():
    engine = FakeEngine()
    routed = Routed(engine.generate)
    sampling = SamplingConfig(max_tokens=9, n=2, seed=3, stop_token_ids=(EOS,))
    batch = PartialBatch.start([[4, 5, 6], [7, 8]], sampling)
    advance(batch, routed, version=0, max_tokens=3, max_model_len=64, token_budget=4096,
            engines=1)
    buffer = io.BytesIO()
    torch.save(batch.to_state(), buffer)
    buffer.seek(0)
    batch = PartialBatch.from_state(torch.load(buffer, weights_only=True))
    while not batch.done:
        advance(batch, routed, version=1, max_tokens=3, max_model_len=64, token_budget=4096,
                engines=1)
    assert batch.chunks >= 2 and engine.calls  # continued after the checkpoint
    unfinished = [s for call in routed.starts[1:] for s in call]
    assert unfinished and all(s > 3 for s in unfinished)  # only the positions not held yet
    for prompt, group in zip(batch.prompt_ids, batch.completions()):
        for c in group:
            assert held_rows_match(prompt, c) == len(prompt) + len(c.token_ids) - 1


def test_batch_rows_sit_on_their_token_positions():
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    completions = [Completion(tuple(r), (), "stop", routing=expected_rows(p + r))
                   for p, r in zip(prompts, responses)]
    batch = build_batch(prompts, responses, 8, 0, routing=[c.routing for c in completions])
    assert batch.routing.shape == (2, 8, LAYERS, K) and batch.routing.dtype == torch.int16
    for row, (p, r) in enumerate(zip(prompts, responses)):
        seq = p + r
        assert torch.equal(batch.routing[row, :len(seq) - 1], expected_rows(seq))
        assert (batch.routing[row, len(seq) - 1:] == -1).all()  # last token and padding
        assert batch.tokens[row, :len(seq)].tolist() == seq[:8]
    # the batch saved with a checkpoint (an off-policy batch ahead) keeps its rows
    rollouts = Rollouts(1, [Example("p", "a")] * 2, prompts, [[c] for c in completions],
                        [[0.0], [1.0]], {})
    buffer = io.BytesIO()
    torch.save(rollouts.to_state(), buffer)
    buffer.seek(0)
    back = Rollouts.from_state(torch.load(buffer, weights_only=True))
    assert all(torch.equal(a[0].routing, b[0].routing)
               for a, b in zip(back.completions, rollouts.completions))


def test_a_sample_without_rows_or_with_too_many_is_named():
    rows = expected_rows([1, 2, 3, 4])
    with pytest.raises(ValueError, match="sample 1: the engines returned no routed experts"):
        batch_rows([rows, None], 8)
    with pytest.raises(ValueError, match=r"sample 0: routed experts of shape \(3, 3, 2\); "
                                         r"expected \[at most 2 positions"):
        batch_rows([rows], 2)
    with pytest.raises(ValueError, match=r"different \[layers, top-k\]"):
        batch_rows([rows, rows[:, :2]], 8)
