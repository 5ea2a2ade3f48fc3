"""Critic (PPO) and frozen reference passes on Megatron models.

The critic is the actor's architecture with the vocab-parallel output layer swapped for a
scalar value head on the last pipeline stage. The head is replicated on every TP rank: the
final norm's output is complete on each TP rank (no sequence parallel in the critic), so every
rank computes the same value and the same head gradient — nothing to reduce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mcore_rl.algorithms import AlgorithmConfig, value_loss
from mcore_rl.trainer.megatron_train import (MegatronTrainer, _run_schedule,
                                             global_report_sum, optimizer_step)
from mcore_rl.trainer.packing import model_inputs


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: [s, b, h] → ([s, b, 1], None). Without `bias` it
    is an HF sequence classifier's `score` head (reward models)."""

    def __init__(self, hidden: int, dtype: torch.dtype, *, bias: bool = True,
                 device: torch.device | str | None = None):
        """device: where the chunk it joins lives (`attach_value_head` passes it)."""
        super().__init__()
        # zero init: values start at 0 on every rank, identically
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
        self.bias = (torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias
                     else None)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def attach_value_head(chunks: list[torch.nn.Module], hidden: int, is_last_stage: bool, *,
                      bias: bool = True) -> None:
    """Replace the last chunk's output layer (last pipeline stage only) by a value head, of
    the chunk's dtype and on its device."""
    if is_last_stage:
        last = chunks[-1]
        if getattr(getattr(last, "config", None), "sequence_parallel", False):
            raise ValueError("a value head reads complete hidden states on each TP rank; "
                             "sequence parallelism hands it 1/tp of the sequence: turn "
                             "sequence_parallel off for the critic and the reward model")
        param = next(last.parameters())
        last.output_layer = ValueHead(hidden, param.dtype, bias=bias, device=param.device)


@dataclass(frozen=True)
class ValueBatch:
    """Critic update micro batch, [b, s] aligned with labels (packed: [1, T] and
    segment_ids, see `packing.pack`). The value loss is a token mean: packing needs no
    per-sequence view of it."""

    tokens: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    segment_ids: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.response_mask


def compute_values(trainer: MegatronTrainer, micro_batches) -> list[torch.Tensor] | None:
    """Critic values [b, s] per micro batch on the last stage (None elsewhere)."""

    def collect(values, non_loss_data=False):
        return values.squeeze(-1).float()

    def step(data_iterator, chunk):
        return chunk(**model_inputs(next(data_iterator), chunk.config)), collect

    with torch.no_grad():
        out = _run_schedule(trainer.model, trainer.groups, micro_batches, forward_step=step,
                            forward_only=True, collect_non_loss_data=True)
    return out if trainer.groups.is_last_stage else None


def _value_loss(batch: ValueBatch, algo: AlgorithmConfig, values: torch.Tensor):
    mask = batch.response_mask.float()
    mean, metrics = value_loss(values.squeeze(-1).float(), batch.old_values, batch.returns,
                               mask, clip=algo.value_clip, agg="token-mean")
    num_tokens = mask.sum()
    loss_sum = mean * num_tokens
    report = torch.stack([loss_sum.detach(), num_tokens,
                          metrics["vf_clipfrac"].detach() * num_tokens])
    return loss_sum, num_tokens.to(torch.int), {"value": report}


def value_update(trainer: MegatronTrainer, micro_batches: list[ValueBatch],
                 algo: AlgorithmConfig) -> dict[str, float]:
    """One critic optimizer step on this DP rank's micro batches (token-mean value loss)."""
    def step(data_iterator, chunk):
        batch = next(data_iterator)
        values = chunk(**model_inputs(batch, chunk.config))
        return values, functools.partial(_value_loss, batch, algo)

    reports, grad_norm = optimizer_step(trainer, micro_batches, step, "critic update")
    totals = global_report_sum([r["value"] for r in reports], trainer.groups, 3)
    tokens = max(float(totals[1]), 1.0)
    return {"vf_loss": float(totals[0]) / tokens, "vf_clipfrac": float(totals[2]) / tokens,
            "critic_grad_norm": float(grad_norm)}


@dataclass
class FrozenModel:
    """A model with no optimizer (the reference policy): what compute_logprobs needs."""

    spec: object
    model: list[torch.nn.Module]
    groups: object
