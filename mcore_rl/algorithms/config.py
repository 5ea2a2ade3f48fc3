"""Config of the RL algorithm: advantage estimator, policy/value/KL/entropy losses, filters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_rl.algorithms.losses import KL_ESTIMATORS, LOSS_AGGS
from mcore_rl.algorithms.rollout_correction import RolloutCorrectionConfig
from mcore_rl.config import require_above, require_at_least, require_in_range, require_one_of

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("gae", "grpo", "rloo", "reinforce_pp")
KL_MODES: tuple[str, ...] = ("loss", "reward")
ROUTING_REPLAY: tuple[str, ...] = ("none", "old", "rollout")


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """How advantages and losses are computed. Defaults: GRPO, token-mean, no KL, no entropy.

    advantage_estimator: "gae" (PPO with a critic), "grpo", "rloo" or "reinforce_pp".
    clip_eps_low / clip_eps_high: PPO ratio clip range [1 - low, 1 + high]; high > low is
        DAPO's clip-higher (DAPO uses 0.2 / 0.28).
    clip_c: dual-clip bound (> 1) on the loss of negative-advantage tokens; null turns it off.
    loss_agg: "token-mean" (DAPO), "seq-mean-token-mean" (GRPO) or "seq-mean-token-sum".
    entropy_coeff: weight of the entropy bonus (>= 0; 0 turns it off).
    kl_coeff: weight of the KL to the reference policy (>= 0; 0 means no reference needed).
    kl_estimator: "k1", "k2" or "k3" (see `losses.kl_divergence`).
    kl_mode: "loss" (a loss term, GRPO) or "reward" (folded into token rewards, PPO /
        REINFORCE++).
    gamma: discount over tokens, in [0, 1] (gae, reinforce_pp).
    lam: GAE lambda, in [0, 1] (gae).
    value_clip: critic clip range around the rollout values (> 0; null turns it off) (gae).
    grpo_norm_by_std: divide GRPO advantages by the group std (false: Dr. GRPO).
    grpo_eps: added to the group std before dividing (> 0).
    dynamic_sampling: drop groups whose rewards are all equal (DAPO).
    overlong_buffer: tokens before the max response length over which the overlong penalty
        ramps from 0 to -overlong_penalty (>= 0; 0 turns it off).
    overlong_penalty: size of the full overlong penalty (>= 0).
    rollout_correction: train–inference mismatch correction (tis / mis / bypass), see
        `RolloutCorrectionConfig`.
    old_logprob_from_update: the first mini-batch's π_old log-probs are its update's own
        forward (detached; the weights have not moved yet), so the forward-only pass runs on
        mini-batches 2.. only. Applies with updates_per_batch >= 2 when nothing needs every
        row's π_old before the update (rollout_correction mode "none", no kl_mode "reward");
        the step's mismatch metrics then cover mini-batches 2.. (TRL does the same with one
        mini-batch). false: the pass covers every row.
    routing_replay: MoE models — which experts the update passes use. "none": each forward's
        routers choose. "old" (R2): the π_old pass records every token's experts per layer
        and every update mini-batch replays them (the pass then covers every row, and runs
        with rollout_correction bypass too, for the routing alone). "rollout" (R3): the
        experts the engines routed each sampled sequence to travel with the samples and are
        replayed in the π_old and update passes (vLLM's routed-expert output: GPU engines with
        prefix caching; a position the engines did not forward routes itself).
    """

    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_c: float | None = 3.0
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    entropy_coeff: float = 0.0
    kl_coeff: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_mode: Literal["loss", "reward"] = "loss"
    gamma: float = 1.0
    lam: float = 1.0
    value_clip: float | None = 0.2
    grpo_norm_by_std: bool = True
    grpo_eps: float = 1e-6
    dynamic_sampling: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    old_logprob_from_update: bool = True
    routing_replay: Literal["none", "old", "rollout"] = "none"

    def __post_init__(self) -> None:
        require_one_of(self, "advantage_estimator", ADVANTAGE_ESTIMATORS)
        require_one_of(self, "loss_agg", LOSS_AGGS)
        require_one_of(self, "kl_estimator", KL_ESTIMATORS)
        require_one_of(self, "kl_mode", KL_MODES)
        require_in_range(self, 0, 1, "clip_eps_low", high_open=True)
        require_at_least(self, 0, "clip_eps_high")
        require_above(self, 1, "clip_c", optional=True, note="null turns dual-clip off")
        require_at_least(
            self, 0, "entropy_coeff", "kl_coeff", "overlong_buffer", "overlong_penalty"
        )
        require_in_range(self, 0, 1, "gamma", "lam")
        require_above(self, 0, "value_clip", optional=True, note="null turns it off")
        require_above(self, 0, "grpo_eps")
        require_one_of(self, "routing_replay", ROUTING_REPLAY)

    @property
    def kl_in_reward(self) -> bool:
        """The KL to the reference is folded into the token rewards (before the advantages)."""
        return bool(self.kl_coeff) and self.kl_mode == "reward"


__all__ = ["ADVANTAGE_ESTIMATORS", "AlgorithmConfig", "KL_MODES", "ROUTING_REPLAY"]
