"""RL algorithms as pure torch functions: advantages, losses, DAPO filters, TP log-probs.

Shapes and masks are stated in each function's docstring; per-token tensors are [B, T] with a
`response_mask` [B, T]. Nothing here reads global parallel state: the one collective function
(`vocab_parallel_log_probs_and_entropy`) takes its TP group as an argument.
"""

from mcore_rl.algorithms.advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    last_token_index,
    masked_mean,
    masked_whiten,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)
from mcore_rl.algorithms.config import ADVANTAGE_ESTIMATORS, KL_MODES, AlgorithmConfig
from mcore_rl.algorithms.filters import dynamic_sampling_keep, overlong_penalty
from mcore_rl.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGS,
    KLEstimator,
    LossAgg,
    aggregate_loss,
    entropy_bonus,
    kl_divergence,
    kl_loss,
    kl_penalty_rewards,
    policy_loss,
    value_loss,
)
from mcore_rl.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    correction_weights,
    mis_mask,
    tis_weights,
)
from mcore_rl.algorithms.vocab_parallel import (
    log_probs_and_entropy,
    vocab_parallel_log_probs_and_entropy,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AlgorithmConfig",
    "KLEstimator",
    "KL_ESTIMATORS",
    "KL_MODES",
    "LOSS_AGGS",
    "LossAgg",
    "aggregate_loss",
    "broadcast_to_tokens",
    "discounted_returns",
    "dynamic_sampling_keep",
    "entropy_bonus",
    "gae_advantages",
    "grpo_advantages",
    "kl_divergence",
    "kl_loss",
    "kl_penalty_rewards",
    "last_token_index",
    "log_probs_and_entropy",
    "masked_mean",
    "masked_whiten",
    "outcome_to_token_rewards",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "RolloutCorrectionConfig",
    "correction_weights",
    "mis_mask",
    "tis_weights",
    "value_loss",
    "vocab_parallel_log_probs_and_entropy",
]
