"""Advantage estimators of the PPO family: GAE (critic), GRPO, RLOO and REINFORCE++.

Conventions for every function here:

- B responses, T response tokens. `response_mask` [B, T] (bool or 0/1 float) is 1 on tokens the
  policy generated and 0 elsewhere: right padding, and in multi-turn rollouts the tool /
  environment tokens in between. Masked positions are *skipped* by the recursions (the value
  and the running return flow through them unchanged) and every output is 0 there.
- Outcome rewards `scores` are per response, [B]. Token-level estimators (GAE, REINFORCE++) take
  them as `token_rewards` [B, T] built by `outcome_to_token_rewards` (reward on the last valid
  token) plus any per-token terms such as the KL penalty (`losses.kl_penalty_rewards`).
- `group_ids` [B] (int) names the prompt each response was sampled for; responses with the same
  id form a group. A group of size 1 has no baseline besides itself, so GRPO and RLOO give it
  advantage 0 (verl instead gives it its raw score, an un-baselined REINFORCE term).
- A group whose rewards are all equal gets advantage exactly 0 (checked explicitly: computing
  `(s - mean) / (std + eps)` in float would turn rounding noise into O(1) advantages).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is 1 (over all dims, or along `dim`).

    Empty selections give 0, not NaN.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean and (population) variance over valid positions.

    x, mask: same shape, e.g. [B, T]. Returns the same shape, 0 where `mask` is 0.
    """
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    return (x - mean) * torch.rsqrt(var + eps) * m


def last_token_index(response_mask: Tensor) -> Tensor:
    """[B, T] mask -> [B] index of each row's last valid token (0 for an empty row)."""
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    return (positions * response_mask.to(torch.long)).argmax(dim=-1)


def outcome_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each response's outcome reward on its last valid token.

    scores: [B]; response_mask: [B, T]. Returns [B, T] float, zero elsewhere (and zero for a
    response with no valid token).
    """
    mask = response_mask.to(torch.float32)
    rewards = torch.zeros_like(mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    last = last_token_index(response_mask)
    rewards[rows, last] = scores.to(torch.float32) * mask[rows, last]
    return rewards


def broadcast_to_tokens(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """[B] per-response value -> [B, T], copied onto every valid token, 0 elsewhere."""
    return per_sequence.to(torch.float32).unsqueeze(-1) * response_mask.to(torch.float32)


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (PPO with a critic).

    token_rewards, values, response_mask: [B, T]. `values[b, t]` is the critic's V of the state
    before token t. Over valid tokens t < t' (t' the next valid token; V = 0 after the last):
        delta_t = r_t + gamma * V_t' - V_t
        A_t     = delta_t + gamma * lam * A_t'
        R_t     = A_t + V_t   (the critic's regression target)
    Returns (advantages, returns), both [B, T] and 0 on masked tokens. With `whiten`, the
    advantages (not the returns) are whitened over the batch's valid tokens.
    """
    mask = response_mask.to(torch.float32)
    rewards, values = token_rewards.to(torch.float32), values.to(torch.float32)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        next_adv = m * adv + (1 - m) * next_adv
        next_value = m * values[:, t] + (1 - m) * next_value
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """[B] prompt ids -> (each response's group number in 0..G-1 [B], G). The estimators'
    one host sync (the number of groups)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-response statistics of its group: (count, sum, unbiased std, all_equal), each [B]."""
    return group_stats(scores, *group_index(group_ids))


def group_stats(
    scores: Tensor, inverse: Tensor, n_groups: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_group_stats` given `group_index`'s result (no host sync)."""
    scores = scores.to(torch.float32)
    zeros = scores.new_zeros(n_groups)
    count = zeros.index_add(0, inverse, torch.ones_like(scores))
    total = zeros.index_add(0, inverse, scores)
    mean = total / count
    sq_dev = zeros.index_add(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1.0))
    lo = zeros.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    hi = zeros.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    return count[inverse], total[inverse], std[inverse], (lo == hi)[inverse]


def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-normalized outcome advantage (GRPO; without std scaling as in Dr. GRPO).

    scores: [B]; group_ids: [B]; response_mask: [B, T].
        A_i = (s_i - mean_g) / (std_g + eps)   if norm_by_std   (std_g unbiased, as torch.std)
        A_i =  s_i - mean_g                    otherwise
    broadcast to the valid tokens of response i. Groups of size 1 and groups with all-equal
    rewards get 0. Returns [B, T].
    """
    scores = scores.to(torch.float32)
    count, total, std, all_equal = _group_stats(scores, group_ids)
    adv = scores - total / count
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(all_equal | (count < 2), torch.zeros_like(adv), adv)
    return broadcast_to_tokens(adv, response_mask)


def rloo_advantages(scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> Tensor:
    """Leave-one-out baseline (RLOO): A_i = s_i - mean of the *other* responses in the group.

    scores: [B]; group_ids: [B]; response_mask: [B, T]. Groups of size 1 and all-equal groups
    get 0. Returns [B, T].
    """
    scores = scores.to(torch.float32)
    count, total, _, all_equal = _group_stats(scores, group_ids)
    adv = scores - (total - scores) / (count - 1).clamp(min=1.0)
    adv = torch.where(all_equal | (count < 2), torch.zeros_like(adv), adv)
    return broadcast_to_tokens(adv, response_mask)


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, *, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_t' over valid tokens (t' the next valid one). [B, T] -> [B, T].

    Rewards on masked tokens are ignored; the result is 0 there.
    """
    mask = response_mask.to(torch.float32)
    rewards = token_rewards.to(torch.float32)
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


def reinforce_pp_advantages(
    token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted returns of token-level rewards, whitened over the batch.

    token_rewards: [B, T], normally the outcome reward on the last token plus the per-token KL
    penalty `-kl_coeff * kl_t` (`losses.kl_penalty_rewards`); response_mask: [B, T].
    Returns (advantages, returns), [B, T]: returns = `discounted_returns`, advantages = returns
    whitened (mean and population variance) over all valid tokens of the batch; 0 on masked
    tokens.
    """
    returns = discounted_returns(token_rewards, response_mask, gamma=gamma)
    return masked_whiten(returns, response_mask, eps=eps), returns


__all__ = [
    "broadcast_to_tokens",
    "discounted_returns",
    "gae_advantages",
    "grpo_advantages",
    "last_token_index",
    "masked_mean",
    "masked_whiten",
    "outcome_to_token_rewards",
    "reinforce_pp_advantages",
    "rloo_advantages",
]
