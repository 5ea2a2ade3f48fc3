"""Device twins of reward-model scoring (see tests/device_twin.py): rows that arrive from the
driver on the host are moved to the model's device before they meet it."""

from __future__ import annotations

import types

import pytest
import torch

from device_twin import TWIN, assert_on_twin, twin
from mcore_rl.parallel import ParallelConfig
from mcore_rl.reward_model import scoring

pytestmark = [pytest.mark.device_twin, pytest.mark.fast]

VOCAB, HIDDEN = 11, 4


class _ScoreChunk(torch.nn.Module):
    """A last-stage chunk ending in a score head: [b, s] ids -> values [b, s, 1]; it refuses
    inputs that are not on its own device, as a CUDA embedding would."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(transformer_impl="local")
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN).to(TWIN))
        self.score = torch.nn.Parameter(torch.randn(1, HIDDEN).to(TWIN))

    def forward(self, input_ids, position_ids, attention_mask):
        for name, t in (("input_ids", input_ids), ("position_ids", position_ids)):
            if t.device != self.embed.device:
                raise RuntimeError(f"{name} on {t.device}, the model on {self.embed.device}")
        return torch.nn.functional.linear(self.embed[input_ids], self.score)


def test_score_batch_moves_the_rows_to_the_model(monkeypatch):
    """scoring.score_batch ran the driver's host tensors through a device model."""
    def run_schedule(chunks, groups, batches, *, forward_step, **kwargs):
        outs = []
        for batch in batches:
            values, collect = forward_step(iter([batch]), chunks[0])
            assert_on_twin(batch.loss_mask)
            outs.append(collect(values))
        return outs

    monkeypatch.setattr("mcore_rl.megatron.schedule.run_schedule", run_schedule)
    groups = types.SimpleNamespace(config=ParallelConfig(), rank_in=lambda axis: 0,
                                   is_last_stage=True)
    model = scoring.RewardModel(types.SimpleNamespace(vocab=VOCAB), [_ScoreChunk()], groups,
                                micro_batch_size=2)
    tokens, lengths = scoring.pad_sequences([[1, 2], [3], [4, 5, 6]], [[7], [8, 9], []], 0)
    scores = scoring.score_batch(model, tokens, lengths)  # host tensors, as from the driver
    assert scores.shape == (3,)
    assert_on_twin(scores)


def test_last_token_scores_on_device():
    values = twin(torch.randn(3, 5, 1))
    assert_on_twin(scoring.last_token_scores(twin(torch.tensor([1, 5, 2])), values))
