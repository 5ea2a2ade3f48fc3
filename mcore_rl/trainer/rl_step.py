"""RL passes on the Megatron actor: log-probs (forward only) and the PPO/GRPO policy update,
both through megatron-core's pipeline schedules, computed vocab-parallel on TP-sharded logits
(no gather of the vocabulary, no whole-model gathers of any kind).

Sequences are [b, s] token ids; position t predicts token t+1, so per-token tensors (labels,
response mask, old log-probs, advantages) are aligned with the *labels* = tokens shifted left.
The loss is a token mean over the global mini-batch: each micro batch returns its masked sum
and token count, and megatron's `finalize_model_grads` divides by the global count
(`calculate_per_token_loss`), exactly as one process over the whole mini-batch would.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mcore_rl.algorithms import AlgorithmConfig, kl_loss, policy_loss
from mcore_rl.algorithms.vocab_parallel import vocab_parallel_log_probs_and_entropy
from mcore_rl.parallel.groups import Axis
from mcore_rl.trainer.megatron_train import (MegatronTrainer, MicroBatch, _run_schedule,
                                             global_report_sum, optimizer_step)

# Megatron's padded vocab rows are not part of the model: their logits are pushed far below
# any real logit (finite, so the entropy's p·logit stays 0·x = 0 rather than 0·inf = nan).
_PAD_LOGIT = -1e4


@dataclass(frozen=True)
class PolicyBatch:
    """One micro batch of the policy update, all [b, s] aligned with `labels`."""

    tokens: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None = None  # with a KL loss term

    @property
    def loss_mask(self) -> torch.Tensor:  # what the schedule helper checks shapes of
        return self.response_mask


def _masked_vocab_logits(logits: torch.Tensor, vocab: int, tp_rank: int) -> torch.Tensor:
    per_rank = logits.shape[-1]
    first_pad = vocab - tp_rank * per_rank
    logits = logits.float()
    if first_pad < per_rank:
        keep = torch.arange(per_rank) < max(first_pad, 0)
        logits = torch.where(keep, logits, torch.full_like(logits, _PAD_LOGIT))
    return logits


def logp_and_entropy(trainer: MegatronTrainer, logits: torch.Tensor,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(label) and entropy from this TP rank's vocab slice ([b, s] each)."""
    tp_rank = trainer.groups.rank_in(Axis.TP)
    masked = _masked_vocab_logits(logits, trainer.spec.vocab, tp_rank)
    tp_group = trainer.groups.group(Axis.TP) if trainer.groups.config.tp > 1 else None
    return vocab_parallel_log_probs_and_entropy(masked, labels, tp_group=tp_group)


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    return torch.arange(s).unsqueeze(0).expand(b, s)


def compute_logprobs(trainer: MegatronTrainer,
                     micro_batches: list[MicroBatch]) -> list[torch.Tensor] | None:
    """Log-probs of the labels per micro batch ([b, s], fp32) on the last pipeline stage;
    None on other stages. Forward only (old / reference log-probs)."""

    def collect(labels, logits, non_loss_data=False):
        # called by the schedule on the last pipeline stage only (others hold hidden states)
        logp, _ = logp_and_entropy(trainer, logits, labels)
        return logp

    def step(data_iterator, chunk):
        batch = next(data_iterator)
        output = chunk(batch.tokens, _positions(batch.tokens), None)
        return output, functools.partial(collect, batch.labels)

    with torch.no_grad():
        out = _run_schedule(trainer.model, trainer.groups, micro_batches, forward_step=step,
                            forward_only=True, collect_non_loss_data=True)
    return out if trainer.groups.is_last_stage else None


def _policy_loss(batch: PolicyBatch, algo: AlgorithmConfig, trainer: MegatronTrainer,
                 logits: torch.Tensor):
    logp, entropy = logp_and_entropy(trainer, logits, batch.labels)
    mask = batch.response_mask.float()
    pg_mean, metrics = policy_loss(logp, batch.old_logp, batch.advantages, mask,
                                   clip_eps_low=algo.clip_eps_low,
                                   clip_eps_high=algo.clip_eps_high, clip_c=algo.clip_c,
                                   agg="token-mean")
    num_tokens = mask.sum()
    loss_sum = pg_mean * num_tokens
    if algo.entropy_coeff:
        loss_sum = loss_sum - algo.entropy_coeff * (entropy * mask).sum()
    kl_sum = torch.zeros(())
    if batch.ref_logp is not None and algo.kl_coeff and algo.kl_mode == "loss":
        kl_mean, kl_metrics = kl_loss(logp, batch.ref_logp, mask, coeff=algo.kl_coeff,
                                      estimator=algo.kl_estimator, agg="token-mean")
        loss_sum = loss_sum + kl_mean * num_tokens
        kl_sum = kl_metrics["kl"] * num_tokens
    report = torch.stack([loss_sum.detach(), num_tokens,
                          metrics["pg_clipfrac"].detach() * num_tokens,
                          metrics["ppo_kl"].detach() * num_tokens,
                          (entropy.detach() * mask).sum(), kl_sum.detach()])
    return loss_sum, num_tokens.to(torch.int), {"policy": report}


def _policy_forward(data_iterator, model, *, algo: AlgorithmConfig, trainer: MegatronTrainer):
    batch = next(data_iterator)
    logits = model(batch.tokens, _positions(batch.tokens), None)
    return logits, functools.partial(_policy_loss, batch, algo, trainer)


def policy_update(trainer: MegatronTrainer, micro_batches: list[PolicyBatch],
                  algo: AlgorithmConfig) -> dict[str, float]:
    """One optimizer step over this DP rank's micro batches (one mini-batch). Returns global
    metrics (identical on every rank): pg_loss, clip_frac, ppo_kl, entropy, grad_norm."""
    reports, grad_norm = optimizer_step(
        trainer, micro_batches, functools.partial(_policy_forward, algo=algo, trainer=trainer),
        "policy update")
    totals = global_report_sum([r["policy"] for r in reports], trainer.groups, 6)
    tokens = max(float(totals[1]), 1.0)
    return {"pg_loss": float(totals[0]) / tokens, "clip_frac": float(totals[2]) / tokens,
            "ppo_kl": float(totals[3]) / tokens, "entropy": float(totals[4]) / tokens,
            "kl_ref": float(totals[5]) / tokens,
            "grad_norm": float(grad_norm), "update_tokens": tokens}
