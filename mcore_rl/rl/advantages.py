"""Advantages by the configured estimator, and the update metrics a step reports."""

from __future__ import annotations

import torch

from mcore_rl.algorithms import (
    AlgorithmConfig,
    gae_advantages,
    grpo_advantages,
    kl_penalty_rewards,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)


def compute_advantages(algo: AlgorithmConfig, scores: torch.Tensor, groups: torch.Tensor,
                       mask: torch.Tensor, old_logp: torch.Tensor,
                       extra: dict[str, torch.Tensor]):
    """Advantages [n, s] (and returns, for the critic) by the configured estimator.

    Group estimators (grpo, rloo) use the sequence scores; token estimators (gae,
    reinforce_pp) use token rewards: the score on the last response token, minus the KL to
    the reference on every token when kl_mode is "reward"."""
    metrics: dict[str, float] = {}
    if algo.advantage_estimator == "grpo":
        return grpo_advantages(scores, groups, mask, norm_by_std=algo.grpo_norm_by_std,
                               eps=algo.grpo_eps), None, metrics
    if algo.advantage_estimator == "rloo":
        return rloo_advantages(scores, groups, mask), None, metrics
    token_rewards = outcome_to_token_rewards(scores, mask)
    if algo.kl_in_reward:
        token_rewards, kl = kl_penalty_rewards(token_rewards, old_logp, extra["ref_logp"], mask,
                                               coeff=algo.kl_coeff, estimator=algo.kl_estimator)
        metrics["kl_reward"] = float(kl["kl"])
    if algo.advantage_estimator == "gae":
        adv, returns = gae_advantages(token_rewards, extra["values"], mask, gamma=algo.gamma,
                                      lam=algo.lam)
        return adv, returns, metrics
    adv, returns = reinforce_pp_advantages(token_rewards, mask, gamma=algo.gamma)
    return adv, returns, metrics


_PACKING = ("pack_efficiency", "pad_efficiency", "micro_batches")


def packing_metrics(update: dict) -> dict[str, float]:
    """The actor update's sequence packing (real tokens / tokens run), when it packs."""
    return {key: update[key] for key in _PACKING if key in update}


def critic_metrics(critic_updates: list[dict]) -> dict[str, float]:
    if not critic_updates:
        return {}
    return {k: v for k, v in critic_updates[-1].items() if k not in _PACKING}



__all__ = ["compute_advantages", "critic_metrics", "packing_metrics"]
