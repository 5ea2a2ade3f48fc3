"""Policy, value, entropy and KL loss terms of PPO-family training.

Conventions: every per-token input is [B, T] and aligned with `response_mask` [B, T] (1 on
generated tokens, 0 on padding / tool tokens). Log-probs are of the sampled token (from
`vocab_parallel`). Each loss function returns `(loss, metrics)`: `loss` is a scalar to minimise
(terms add up: `pg + entropy_bonus + kl_loss + value_loss`), `metrics` maps names to detached
scalar tensors (no host sync is forced). Metrics are always token means over valid tokens.

Aggregation (`agg`) of a per-token loss L [B, T] into a scalar:
- "token-mean": sum of L over all valid tokens / number of valid tokens (DAPO; every token
  weighs the same, so long responses are not down-weighted).
- "seq-mean-token-mean": mean over tokens within each response, then mean over responses
  (original GRPO).
- "seq-mean-token-sum": sum over tokens within each response, then mean over responses.
Responses with no valid token are left out of the sequence means. The normaliser is local to
the batch given: with micro-batching / DP, the caller scales if it wants a global mean.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from mcore_rl.algorithms.advantages import masked_mean

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]
LOSS_AGGS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

# exp() of a log-ratio beyond this overflows the ratio; clamp as verl/OpenRLHF do.
_MAX_LOG_RATIO = 20.0
# k3 is clamped to [-K3_CLAMP, K3_CLAMP] (verl's low_var_kl) so one outlier token cannot dominate.
K3_CLAMP = 10.0


def aggregate_loss(loss: Tensor, response_mask: Tensor, agg: LossAgg) -> Tensor:
    """Per-token loss [B, T] -> scalar, over valid tokens, as described in the module docstring."""
    mask = response_mask.to(loss.dtype)
    if agg == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    per_seq_tokens = mask.sum(-1)
    per_seq = (loss * mask).sum(-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / per_seq_tokens.clamp(min=1.0)
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"agg={agg!r}: allowed values: {', '.join(LOSS_AGGS)}")
    has_tokens = (per_seq_tokens > 0).to(loss.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    clip_c: float | None = None,
    agg: LossAgg = "token-mean",
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and optional dual-clip.

    logp (with grad), old_logp (behaviour policy), advantages, response_mask: [B, T].
    With r = exp(logp - old_logp) and A the advantage, per token:
        L = max(-A * r, -A * clip(r, 1 - clip_eps_low, 1 + clip_eps_high))
        if clip_c is set and A < 0:  L = min(L, -A * clip_c)    (dual-clip, clip_c > 1)
    then multiplied by `is_weights` [B, T] when given (detached per-token weights of the
    train–inference mismatch correction, `rollout_correction`) and aggregated with `agg`
    (the normaliser stays the response mask's). Metrics: "pg_clipfrac" (tokens where the
    clipped term is active), "pg_clipfrac_lower" (tokens where dual-clip is active), "ppo_kl"
    (mean of old_logp - logp, the k1 estimate of KL(old || new)).
    """
    mask = response_mask.to(torch.float32)
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    if clip_c is not None:
        dual = -advantages * clip_c
        negative = advantages < 0
        metrics["pg_clipfrac_lower"] = masked_mean(
            ((loss > dual) & negative).float(), mask
        ).detach()
        loss = torch.where(negative, torch.minimum(loss, dual), loss)
    else:
        metrics["pg_clipfrac_lower"] = loss.new_zeros(())
    if is_weights is not None:
        loss = loss * is_weights.detach().to(loss.dtype)
    return aggregate_loss(loss, mask, agg), metrics


def entropy_bonus(
    entropy: Tensor, response_mask: Tensor, *, coeff: float, agg: LossAgg = "token-mean"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss term -coeff * agg(entropy) (adding it to the loss rewards higher entropy).

    entropy, response_mask: [B, T]. Metric "entropy": token mean of the entropy.
    """
    loss = -coeff * aggregate_loss(entropy, response_mask, agg)
    return loss, {"entropy": masked_mean(entropy, response_mask).detach()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip: float | None = 0.2,
    agg: LossAgg = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss (PPO).

    values (with grad), old_values (at rollout), returns (GAE targets), response_mask: [B, T].
        v_clip = old_values + clip(values - old_values, -clip, clip)
        L      = 0.5 * max((values - returns)^2, (v_clip - returns)^2)    (clip=None: no max)
    Metric "vf_clipfrac": tokens where the clipped error is the larger one.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        loss, clipfrac = 0.5 * unclipped, unclipped.new_zeros(())
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask).detach()
    return aggregate_loss(loss, response_mask, agg), {"vf_clipfrac": clipfrac}


def kl_divergence(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs ([B, T]).

    With d = ref_logp - logp (log of p_ref / p_policy at the sampled token):
        k1 = -d                                   unbiased, high variance, can be negative
        k2 = d^2 / 2                              biased, low variance
        k3 = exp(d) - d - 1, clamped to [-10, 10] unbiased, >= 0, low variance (Schulman)
    (d itself is clamped to +-20 before exp().)
    """
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(d) - d - 1.0).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"estimator={estimator!r}: allowed values: {', '.join(KL_ESTIMATORS)}")


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    response_mask: Tensor,
    *,
    coeff: float,
    estimator: KLEstimator = "k3",
    agg: LossAgg = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL to the reference policy as a loss term: coeff * agg(kl_divergence(logp, ref_logp)).

    logp (with grad), ref_logp, response_mask: [B, T]. Metric "kl": token mean of the estimate.
    """
    kl = kl_divergence(logp, ref_logp, estimator)
    return (
        coeff * aggregate_loss(kl, response_mask, agg),
        {"kl": masked_mean(kl, response_mask).detach()},
    )


def kl_penalty_rewards(
    token_scores: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    response_mask: Tensor,
    *,
    coeff: float,
    estimator: KLEstimator = "k1",
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL to the reference folded into token rewards (PPO/RLHF, REINFORCE++ style).

    token_scores (e.g. `outcome_to_token_rewards`), logp (rollout / old policy), ref_logp,
    response_mask: [B, T]. Returns (rewards, metrics) with
        rewards = (token_scores - coeff * kl_divergence(logp, ref_logp)) * response_mask
    computed without grad. Metric "kl": token mean of the estimate.
    """
    with torch.no_grad():
        mask = response_mask.to(torch.float32)
        kl = kl_divergence(logp.detach().float(), ref_logp.detach().float(), estimator)
        rewards = (token_scores.float() - coeff * kl) * mask
    return rewards, {"kl": masked_mean(kl, mask)}


__all__ = [
    "K3_CLAMP",
    "KLEstimator",
    "KL_ESTIMATORS",
    "LOSS_AGGS",
    "LossAgg",
    "aggregate_loss",
    "entropy_bonus",
    "kl_divergence",
    "kl_loss",
    "kl_penalty_rewards",
    "policy_loss",
    "value_loss",
]
