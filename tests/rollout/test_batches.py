"""The engine's log-probs placed on the response mask for the whole batch at once
(rollout/batches.py) equal the row-by-row placement they replaced, bit for bit; each DP
slice of a step's batch holds exactly the rows its ranks train on, and only those."""

from __future__ import annotations

import random

import pytest
import torch

from mcore_rl.rollout.engine import Completion
from mcore_rl.rollout.batches import (build_batch, dp_slice, engine_logprobs, mini_batches,
                                     rollout_logprob_diff)

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


@pytest.mark.parametrize("dp,count", [(1, 1), (2, 1), (2, 2), (4, 2), (2, 3)])
def test_a_dp_slice_holds_its_share_of_every_mini_batch_and_nothing_else(dp, count):
    """N14: the controller sends each DP slice only its rows. On the rank, the mini-batches
    of its slice are its contiguous 1/dp of each of the step's mini-batches — the rows the
    rank used to cut from the whole batch — and a serialized slice carries its rows alone."""
    import pickle

    n, s = 4 * dp * count, 1000
    batch = {"tokens": torch.arange(n * s).reshape(n, s),
             "routing": torch.arange(n * s * 2).reshape(n, s, 2).to(torch.int16)}
    per = n // count // dp
    whole = len(pickle.dumps(batch["tokens"]))
    for rank in range(dp):
        mine = dp_slice(batch, dp, rank, count)
        got = list(mini_batches(mine, count))
        want = [{k: v[rank * per:(rank + 1) * per] for k, v in mini.items()}
                for mini in mini_batches(batch, count)]
        assert len(got) == count
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in g)
        if dp > 1:  # its own storage: a view of the batch would pickle the whole of it
            assert len(pickle.dumps(mine["tokens"])) < whole / dp + 2048


def test_a_mini_batch_that_does_not_split_over_dp_is_refused():
    batch = {"tokens": torch.zeros(6, 3)}
    with pytest.raises(ValueError, match="a mini-batch of 3 sequences does not split over dp=2"):
        dp_slice(batch, 2, 0, count=2)
