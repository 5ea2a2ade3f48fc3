"""RL passes on the Megatron actor: log-probs (forward only) and the PPO/GRPO policy update,
both through megatron-core's pipeline schedules, computed vocab-parallel on TP-sharded logits
(no gather of the vocabulary, no whole-model gathers of any kind).

Sequences are [b, s] token ids; position t predicts token t+1, so per-token tensors (labels,
response mask, old log-probs, advantages) are aligned with the *labels* = tokens shifted left.
Micro batches are fixed [b, s] rows or packed [1, T] rows (`mcore_rl.megatron.packing`); the
model inputs of either come from `packing.model_inputs`.

Loss aggregation (`AlgorithmConfig.loss_agg`) is global over the mini-batch: each micro batch
returns (its aggregate × its normaliser, the normaliser) — the token count for "token-mean",
the number of sequences with a response token for the sequence means — and megatron's
`finalize_model_grads` divides the gradients by the normaliser summed over micro batches and DP
(`calculate_per_token_loss`), exactly as `aggregate_loss` in one process over the whole
mini-batch would. The entropy bonus and KL loss terms aggregate the same way.

The update computes logits only where a response token is (`PolicyBatch.logit_window`): the
output layer — a large share of a small model's work, and its [tokens, vocab] logits the
largest activation — and the loss skip the prompt positions, whose loss weight is zero (as
TRL's `logits_to_keep`). Same loss and gradients; not with sequence parallelism (the output
layer's input is split along the sequence there) or packed rows.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch

from mcore_rl.algorithms import AlgorithmConfig, aggregate_loss, kl_loss, policy_loss
from mcore_rl.algorithms.vocab_parallel import chunked_log_probs_and_entropy
from mcore_rl.parallel.groups import Axis
from mcore_rl.megatron.train import (MegatronTrainer, MicroBatch, global_report_sum,
                                     optimizer_step)
from mcore_rl.megatron import routing_replay as rr
from mcore_rl.megatron.packing import model_inputs, per_sequence_view
from mcore_rl.megatron.schedule import run_schedule

@dataclass(frozen=True)
class PolicyBatch:
    """One micro batch of the policy update, all [b, s] aligned with `labels` (packed: [1, T]
    and segment_ids, see `packing.pack`). A NaN in `old_logp` marks a token whose π_old is
    the update's own forward, detached (`AlgorithmConfig.old_logprob_from_update`)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None = None  # with a KL loss term
    is_weights: torch.Tensor | None = None  # rollout correction (tis / mis), detached
    segment_ids: torch.Tensor | None = None
    segment_lengths: tuple[int, ...] | None = None  # packed: the host counts (`packing.pack`)
    routing: torch.Tensor | None = None  # MoE experts to replay [b, s, layers, k]
    # the label positions [lo, hi) holding every response token of the micro batch (host
    # ints, `packing.response_window`): the only ones the update computes logits for;
    # None: all
    logit_window: tuple[int, int] | None = None

    @property
    def loss_mask(self) -> torch.Tensor:  # what the schedule helper checks shapes of
        return self.response_mask

    def cropped(self, lo: int, hi: int) -> PolicyBatch:
        """The per-token fields at label positions [lo, hi) (the logits the update computed)."""
        per_token = {name: getattr(self, name)[:, lo:hi] for name in _PER_TOKEN
                     if getattr(self, name) is not None}
        return replace(self, **per_token, logit_window=None)


# the [b, s] fields of PolicyBatch that the loss reads per label position
_PER_TOKEN = ("labels", "response_mask", "old_logp", "advantages", "ref_logp", "is_weights")


@contextlib.contextmanager
def logits_only_in(chunk: torch.nn.Module, window: tuple[int, int] | None):
    """While it is open, `chunk`'s output layer (on the last pipeline stage) computes logits
    for sequence positions [lo, hi) only: its input hidden states [s, b, h] are cut to
    [hi - lo, b, h] first, so the logits are [b, hi - lo, V]."""
    layer = getattr(rr.unwrapped(chunk), "output_layer", None)
    if window is None or layer is None:
        yield
        return
    lo, hi = window

    def keep(module, args, kwargs):
        return (args[0][lo:hi], *args[1:]), kwargs

    # first of the layer's hooks: megatron's [s, b, h] (models.gpt.batch_major_output's
    # hook, when there, transposes what this one keeps)
    handle = layer.register_forward_pre_hook(keep, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def logp_and_entropy(trainer: MegatronTrainer, logits: torch.Tensor,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(label) and entropy from this TP rank's vocab slice ([b, s] each), a
    chunk of tokens at a time in fp32 (`chunked_log_probs_and_entropy`): megatron's padded
    vocabulary ids are left out, and no fp32 copy of the whole [b, s, V/tp] logits is made."""
    tp_group = trainer.groups.group(Axis.TP) if trainer.groups.config.tp > 1 else None
    return chunked_log_probs_and_entropy(logits, labels, vocab=trainer.spec.vocab,
                                         tp_group=tp_group)


def compute_logprobs(trainer: MegatronTrainer, micro_batches: list[MicroBatch], *,
                     routing_out: list | None = None) -> list[torch.Tensor] | None:
    """Log-probs of the labels per micro batch ([b, s], fp32) on the last pipeline stage;
    None on other stages. Forward only (old / reference log-probs). A micro batch with a
    `logit_window` gets logits and log-probs there only (0 elsewhere: no response token is
    there; not with sequence parallelism or packed rows, as the update). A micro batch with
    `routing` replays it (megatron/routing_replay.py); `routing_out` (a list): filled with each
    micro batch's routing as this rank's MoE routers chose it, [b, s, layers, k] (-1 in the
    layers other stages hold; gathered over TP with sequence parallelism)."""
    recorded: dict[int, list[torch.Tensor]] = {}

    def collect(labels, window, logits, non_loss_data=False):
        # called by the schedule on the last pipeline stage only (others hold hidden states)
        if window is None:
            return logp_and_entropy(trainer, logits, labels)[0]
        lo, hi = window
        logp = logits.new_zeros(labels.shape, dtype=torch.float32)
        logp[:, lo:hi] = logp_and_entropy(trainer, logits, labels[:, lo:hi])[0]
        return logp

    def step(data_iterator, chunk):
        batch = next(data_iterator)
        sp_group = _sequence_parallel_group(trainer, chunk)
        window = _window_of(batch, sp_group)
        record = rr.recording(chunk) if routing_out is not None else contextlib.nullcontext()
        with rr.replaying_rows(chunk, batch.routing, sp_group), record, \
                logits_only_in(chunk, window):
            out = chunk(**model_inputs(batch, chunk.config))
        if routing_out is not None:
            recorded.setdefault(id(chunk), []).append(rr.recorded_rows(
                chunk, batch.tokens.shape[0], trainer.spec.layers, sp_group))
        return out, functools.partial(collect, batch.labels, window)

    with torch.no_grad():
        out = run_schedule(trainer.model, trainer.groups, micro_batches, forward_step=step,
                           forward_only=True, collect_non_loss_data=True)
    if routing_out is not None:  # micro batch i: the i-th forward of every chunk, merged
        routing_out.extend(torch.stack(parts).amax(0) for parts in zip(*recorded.values()))
    return out if trainer.groups.is_last_stage else None


def _window_of(batch: MicroBatch | PolicyBatch, sp_group) -> tuple[int, int] | None:
    """The micro batch's logit window where it applies: not with sequence parallelism (the
    output layer's input is split along the sequence) or packed rows."""
    return batch.logit_window if sp_group is None and batch.segment_ids is None else None


def _sequence_parallel_group(trainer: MegatronTrainer, chunk):
    """The TP group when `chunk` shards activations along the sequence (else None)."""
    return (trainer.groups.group(Axis.TP) if rr.unwrapped(chunk).config.sequence_parallel
            else None)


def _normaliser(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """What `aggregate_loss(·, mask, agg)` divides by: valid tokens, or sequences with one."""
    if agg == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).float().sum()


def _policy_loss(batch: PolicyBatch, algo: AlgorithmConfig, trainer: MegatronTrainer,
                 logits: torch.Tensor):
    logp, entropy = logp_and_entropy(trainer, logits, batch.labels)  # batch: cropped to them
    # one row per sequence (packed rows are split by segment) so that the library's
    # aggregation sees sequences, then × the normaliser = this micro batch's share of the sum
    rows = per_sequence_view(batch.segment_ids, batch.segment_lengths, logp.device)
    logp, entropy, mask = rows(logp), rows(entropy), rows(batch.response_mask.float())
    agg = algo.loss_agg
    old_logp = rows(batch.old_logp)
    old_logp = torch.where(old_logp.isnan(), logp.detach(), old_logp)  # see PolicyBatch
    pg, metrics = policy_loss(logp, old_logp, rows(batch.advantages), mask,
                              clip_eps_low=algo.clip_eps_low, clip_eps_high=algo.clip_eps_high,
                              clip_c=algo.clip_c, agg=agg,
                              is_weights=None if batch.is_weights is None
                              else rows(batch.is_weights))
    weight, num_tokens = _normaliser(mask, agg), mask.sum()
    loss = pg
    if algo.entropy_coeff:
        loss = loss - algo.entropy_coeff * aggregate_loss(entropy, mask, agg)
    kl_sum = pg.new_zeros(())
    if batch.ref_logp is not None and algo.kl_coeff and algo.kl_mode == "loss":
        kl, kl_metrics = kl_loss(logp, rows(batch.ref_logp), mask, coeff=algo.kl_coeff,
                                 estimator=algo.kl_estimator, agg=agg)
        loss = loss + kl
        kl_sum = kl_metrics["kl"] * num_tokens
    report = torch.stack([pg.detach() * weight, weight, num_tokens,
                          metrics["pg_clipfrac"].detach() * num_tokens,
                          metrics["ppo_kl"].detach() * num_tokens,
                          (entropy.detach() * mask).sum(), kl_sum.detach(),
                          loss.detach() * weight])
    # no host sync here (this runs inside the pipeline schedule): 0 without response tokens
    moved = torch.where(mask > 0, (logp.detach() - old_logp).abs(), 0.0).amax()
    return loss * weight, weight.to(torch.int), {"policy": report, "logp_moved": moved}


def _policy_forward(data_iterator, model, *, algo: AlgorithmConfig, trainer: MegatronTrainer):
    batch = next(data_iterator)
    sp_group = _sequence_parallel_group(trainer, model)
    window = _window_of(batch, sp_group)
    with rr.replaying_rows(model, batch.routing, sp_group, training=True), \
            logits_only_in(model, window):
        logits = model(**model_inputs(batch, model.config))
    if window is not None:
        batch = batch.cropped(*window)
    return logits, functools.partial(_policy_loss, batch, algo, trainer)


def policy_update(trainer: MegatronTrainer, micro_batches: list[PolicyBatch],
                  algo: AlgorithmConfig) -> dict[str, float]:
    """One optimizer step over this DP rank's micro batches (one mini-batch). Returns global
    metrics (identical on every rank): pg_loss (the policy term, aggregated by
    `algo.loss_agg` over the mini-batch), loss (with the entropy and KL terms), clip_frac,
    ppo_kl, entropy, kl_ref (token means), grad_norm, update_tokens; and, local to this rank
    (NaN where no loss ran: pipeline stages before the last), logp_moved_local: the largest
    |log π_θ - log π_old| on its response tokens before the step — on the first mini-batch
    with π_old = the engine's log-probs (rollout_correction bypass), the train–inference
    mismatch the old-log-prob pass would have measured."""
    reports, grad_norm = optimizer_step(
        trainer, micro_batches, functools.partial(_policy_forward, algo=algo, trainer=trainer),
        "policy update")
    totals = global_report_sum([r["policy"] for r in reports], trainer.groups, 8)
    weight, tokens = max(float(totals[1]), 1.0), max(float(totals[2]), 1.0)
    return {"pg_loss": float(totals[0]) / weight, "loss": float(totals[7]) / weight,
            "clip_frac": float(totals[3]) / tokens, "ppo_kl": float(totals[4]) / tokens,
            "entropy": float(totals[5]) / tokens, "kl_ref": float(totals[6]) / tokens,
            "grad_norm": float(grad_norm), "update_tokens": float(totals[2]),
            "logp_moved_local": (float(torch.stack([r["logp_moved"] for r in reports]).max())
                                 if reports else float("nan"))}
