"""Critic (PPO) and frozen reference passes on Megatron models.

The critic is the actor's architecture with the vocab-parallel output layer swapped for a
scalar value head on the last pipeline stage. The head is replicated on every TP rank. Without
sequence parallelism the final norm's output is complete on each TP rank, so every rank
computes the same values and the same head gradient — nothing to reduce. With it, TP rank t
holds the sequence shard [t·s/tp, (t+1)·s/tp): the head runs on that shard and all-gathers
the values over TP (every rank then holds all of them, as without SP), and its weight and
bias are marked `sequence_parallel` like Megatron's SP norms, so finalize_model_grads sums
their per-shard gradients over TP.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel

from mcore_rl.algorithms import AlgorithmConfig, value_loss
from mcore_rl.megatron.train import MegatronTrainer, global_report_sum, optimizer_step
from mcore_rl.megatron.packing import model_inputs
from mcore_rl.megatron.schedule import run_schedule


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: [s, b, h] → ([s, b, 1], None). Without `bias` it
    is an HF sequence classifier's `score` head (reward models).

    sequence_parallel_group: the TP group when the model runs sequence parallel. Rank t then
    gets hidden states [s/tp, b, h] (its sequence shard, in TP-rank order) and returns the
    gathered values [s, b, 1], the same on every TP rank. The gradient of those values is the
    same on every rank (the loss downstream is computed identically on each), so the backward
    splits it to each rank's shard (megatron's `tensor_parallel_output_grad=False`); a
    reduce-scatter would multiply it by tp. Weight and bias gradients are then partial sums
    over the shard: `param.sequence_parallel` makes finalize_model_grads all-reduce them over
    TP (with the SP norms' weights)."""

    def __init__(self, hidden: int, dtype: torch.dtype, *, bias: bool = True,
                 device: torch.device | str | None = None, sequence_parallel_group=None):
        """device: where the chunk it joins lives (`attach_value_head` passes it)."""
        super().__init__()
        # zero init: values start at 0 on every rank, identically
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
        self.bias = (torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias
                     else None)
        self.sequence_parallel_group = sequence_parallel_group
        if sequence_parallel_group is not None:
            for param in self.parameters():
                param.sequence_parallel = True

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        if self.sequence_parallel_group is not None:
            values = tensor_parallel.gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False, group=self.sequence_parallel_group)
        return values, None


def attach_value_head(chunks: list[torch.nn.Module], hidden: int, is_last_stage: bool, *,
                      bias: bool = True, tp_group=None) -> None:
    """Replace the last chunk's output layer (last pipeline stage only) by a value head, of
    the chunk's dtype and on its device. tp_group: the grid's TP group, needed when the chunk
    runs sequence parallel (its `config.sequence_parallel`): the head then gathers its values
    over it (see ValueHead)."""
    if is_last_stage:
        last = chunks[-1]
        sp_group = None
        if getattr(getattr(last, "config", None), "sequence_parallel", False):
            if tp_group is None:
                raise ValueError("tp_group: the model runs sequence parallel, so its value "
                                 "head gathers the values over the TP group: pass it")
            sp_group = tp_group
        param = next(last.parameters())
        last.output_layer = ValueHead(hidden, param.dtype, bias=bias, device=param.device,
                                      sequence_parallel_group=sp_group)


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
    segment_lengths: tuple[int, ...] | None = None  # packed: the host counts (`packing.pack`)

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
        out = run_schedule(trainer.model, trainer.groups, micro_batches, forward_step=step,
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
