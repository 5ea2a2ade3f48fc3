"""The engine's log-probs placed on the response mask for the whole batch at once
(rollout/batches.py) equal the row-by-row placement they replaced, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from mcore_rl.rollout.engine import Completion
from mcore_rl.rollout.batches import build_batch, engine_logprobs, rollout_logprob_diff

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def _batch(seed: int, short_rows=()):
    """Prompts and responses of random lengths; rows in `short_rows` carry fewer engine
    log-probs than response tokens."""
    rng = random.Random(seed)
    prompts, completions = [], []
    for row in range(37):
        prompts.append([rng.randrange(3, 50) for _ in range(rng.randint(1, 6))])
        ids = tuple(rng.randrange(3, 50) for _ in range(rng.randint(0, 7)))
        n_lp = max(0, len(ids) - 2) if row in short_rows else len(ids)
        completions.append(Completion(ids, tuple(rng.uniform(-9, 0) for _ in range(n_lp)),
                                      "length"))
    batch = build_batch(prompts, [c.token_ids for c in completions], 16, 0)
    return completions, batch.mask


def _rowwise_logprobs(completions, mask):
    out = torch.zeros_like(mask, dtype=torch.float32)
    for row, c in enumerate(completions):
        positions = mask[row].nonzero().flatten()
        out[row, positions] = torch.tensor(c.logprobs[:len(positions)])
    return out


def _rowwise_diff(completions, actor, mask):
    worst = 0.0
    for row, c in enumerate(completions):
        positions = mask[row].nonzero().flatten()
        n = min(len(positions), len(c.logprobs))
        if n:
            engine = torch.tensor(c.logprobs[:n])
            worst = max(worst, float((engine - actor[row, positions[:n]]).abs().max()))
    return worst


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_placement_equals_rowwise(seed):
    completions, mask = _batch(seed)
    placed = engine_logprobs(completions, mask)
    assert torch.equal(placed, _rowwise_logprobs(completions, mask))
    assert placed[mask == 0].eq(0).all() and placed[mask != 0].ne(0).all()
    actor = placed + torch.randn(placed.shape, generator=torch.Generator().manual_seed(seed))
    assert rollout_logprob_diff(completions, actor, mask) == _rowwise_diff(completions, actor,
                                                                          mask) > 0
    assert rollout_logprob_diff(completions, placed, mask) == 0.0


def test_short_rows_are_compared_on_their_first_tokens_and_refused_as_rollout_logprobs():
    completions, mask = _batch(3, short_rows={4, 10, 11})
    actor = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))
    assert rollout_logprob_diff(completions, actor, mask) == _rowwise_diff(completions, actor,
                                                                          mask)
    with pytest.raises(ValueError, match=r"sample 4: the engine returned \d+ log-probs for "
                                         r"\d+ response tokens"):
        engine_logprobs(completions, mask)
    empty = [Completion(c.token_ids, (), c.finish_reason) for c in completions]
    assert rollout_logprob_diff(empty, actor, mask) == 0.0
