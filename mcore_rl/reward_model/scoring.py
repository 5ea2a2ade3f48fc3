"""Scoring on Megatron: this rank's chunks with the score head as the last stage's output
layer, forward only through megatron's schedule in fixed-shape padded micro batches, rows split
over DP."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.config.dtypes import torch_dtype
from mcore_rl.layouts import materialize_rank, megatron_shards
from mcore_rl.megatron.packing import model_inputs
from mcore_rl.models.hf_weights import SafetensorsWeights
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.groups import Axis
from mcore_rl.reward_model.config import RewardModelConfig, RewardModelError
from mcore_rl.reward_model.weights import check_reward_model_dir


@dataclass(frozen=True)
class ScoreBatch:
    """One micro batch: tokens [b, s] right-padded, lengths [b] (real tokens per row)."""

    tokens: torch.Tensor
    lengths: torch.Tensor

    # what megatron.schedule.check_micro_batches compares shapes of
    @property
    def labels(self) -> torch.Tensor:
        return self.tokens

    @property
    def loss_mask(self) -> torch.Tensor:
        positions = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return (positions < self.lengths.unsqueeze(1)).float()


@dataclass
class RewardModel:
    """This rank's model chunks (the last stage's output layer is the score head)."""

    spec: ModelSpec
    chunks: list[torch.nn.Module]
    groups: object  # ParallelGroups
    micro_batch_size: int


def load_reward_model(cfg: RewardModelConfig, groups, spec: ModelSpec | None = None, *,
                      layer_spec: str = "local") -> RewardModel:
    """Build this rank's chunks for `groups`' grid with megatron's `layer_spec` (the run's) and
    stream its slices of the checkpoint (embedding on stage 0, decoder layers of its stage,
    final norm and score head on the last stage; TP-split and named as the actor's)."""
    from mcore_rl.megatron.value import attach_value_head  # lazy: megatron
    from mcore_rl.models.gpt import build_gpt_model, load_chunks  # lazy: megatron

    spec = spec or check_reward_model_dir(cfg.hf_dir)
    parallel, dtype = groups.config, torch_dtype(cfg.dtype)
    chunks = build_gpt_model(spec, parallel, groups, params_dtype=dtype, layer_spec=layer_spec)
    # HF's score head has no bias; strict loading then checks every tensor arrived. Under
    # sequence parallelism it gathers the scores over TP (critic.ValueHead).
    attach_value_head(chunks, spec.hidden, groups.is_last_stage, bias=False,
                      tp_group=groups.group(Axis.TP))
    weights = SafetensorsWeights(cfg.hf_dir)
    shards = megatron_shards(spec, parallel, layer_spec=layer_spec)
    load_chunks(chunks, materialize_rank(shards, groups.rank, weights.__getitem__, dtype),
                parallel.vpp)
    for chunk in chunks:
        chunk.eval().requires_grad_(False)
    return RewardModel(spec, chunks, groups, cfg.micro_batch_size)


def check_score_inputs(tokens: torch.Tensor, lengths: torch.Tensor, vocab: int) -> None:
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise RewardModelError(f"tokens: expected a [n, s] torch.long tensor, got "
                               f"{tuple(tokens.shape)} {tokens.dtype}")
    if lengths.shape != (tokens.shape[0],) or lengths.dtype != torch.long:
        raise RewardModelError(f"lengths: expected a [{tokens.shape[0]}] torch.long tensor, "
                               f"got {tuple(lengths.shape)} {lengths.dtype}")
    bad = ((lengths < 1) | (lengths > tokens.shape[1])).nonzero().flatten()
    if len(bad):
        raise RewardModelError(f"lengths[{int(bad[0])}]={int(lengths[bad[0]])}: must be in "
                               f"[1, {tokens.shape[1]}] (the padded length)")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise RewardModelError(f"tokens: ids must be in [0, {vocab}), got "
                               f"[{int(tokens.min())}, {int(tokens.max())}]")


def score_batch(model: RewardModel, tokens: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor | None:
    """Scores [n] (fp32) of right-padded rows: the head's output at token lengths[i] - 1.

    Collective over the reward world (every rank gets the same tokens). Rows are padded with
    dummy rows to dp * k * micro_batch_size, and with sequence parallelism right-padded to a
    length divisible by tp; DP rank d scores its contiguous block; the last
    stage all-gathers the blocks over DP. Returns the [n] scores on the rank at (tp 0, last
    stage, dp 0), None elsewhere, on the model's device (the rows are moved there).
    """
    from mcore_rl.megatron.schedule import run_schedule  # lazy: megatron

    groups, mbs = model.groups, model.micro_batch_size
    check_score_inputs(tokens, lengths, model.spec.vocab)  # on the host, as they arrive
    on = next(model.chunks[0].parameters()).device  # the model's device: where they run
    tokens, lengths = tokens.to(on), lengths.to(on)
    n, dp = tokens.shape[0], groups.config.dp
    if groups.config.sequence_parallel and tokens.shape[1] % groups.config.tp:
        # the sequence splits over TP; pad columns (id 0) come after every row's last real
        # token, which is all a causal model scores
        pad = groups.config.tp - tokens.shape[1] % groups.config.tp
        tokens = torch.cat([tokens, tokens.new_zeros(n, pad)], dim=1)
    per_dp = max(1, -(-n // (dp * mbs))) * mbs
    # dummy rows: one pad token (id 0), scored and dropped
    tokens = torch.cat([tokens, tokens.new_zeros(per_dp * dp - n, tokens.shape[1])])
    lengths = torch.cat([lengths, lengths.new_ones(per_dp * dp - n)])
    start = groups.rank_in(Axis.DP) * per_dp
    batches = [ScoreBatch(tokens[i:i + mbs], lengths[i:i + mbs])
               for i in range(start, start + per_dp, mbs)]

    def step(data_iterator, chunk):
        batch = next(data_iterator)
        # unpacked rows: causal attention, so a right-padded row's real tokens never see its pads
        out = chunk(**model_inputs(batch, chunk.config))
        return out, functools.partial(last_token_scores, batch.lengths)

    with torch.no_grad():
        out = run_schedule(model.chunks, groups, batches, forward_step=step,
                           forward_only=True, collect_non_loss_data=True)
    if not groups.is_last_stage:
        return None
    mine = torch.cat(out)
    if dp > 1:
        parts = [torch.empty_like(mine) for _ in range(dp)]
        dist.all_gather(parts, mine, group=groups.group(Axis.DP))
        mine = torch.cat(parts)
    if groups.rank_in(Axis.TP) != 0 or groups.rank_in(Axis.DP) != 0:
        return None
    return mine[:n]


def last_token_scores(lengths: torch.Tensor, values: torch.Tensor,
                      non_loss_data: bool = False) -> torch.Tensor:
    """The schedule's collect function (last stage only): values [b, s, 1] (batch first) →
    each row's score at its last real token, [b] fp32."""
    rows = torch.arange(len(lengths), device=values.device)
    return values[rows, lengths - 1, 0].float()


def pad_sequences(prompts: list[list[int]], responses: list[list[int]],
                  pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt + response per row, right-padded with pad_id: (tokens [n, s], lengths [n])."""
    if len(prompts) != len(responses):
        raise RewardModelError(f"prompts: {len(prompts)} rows but responses: "
                               f"{len(responses)} rows")
    rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
    for i, row in enumerate(rows):
        if not row:
            raise RewardModelError(f"prompts[{i}] + responses[{i}]: empty sequence")
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    tokens = torch.full((len(rows), int(lengths.max()) if rows else 0), pad_id,
                        dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return tokens, lengths
