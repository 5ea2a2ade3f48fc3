"""Train–inference mismatch correction: the engine that sampled a token (π_rollout, vLLM) and
the trainer that scores it (π_old, Megatron) do not give it the same probability — kernels
differ, the engine may hold older weights (off-policy / async), the wire dtype may round.

Per token, with r = π_old / π_rollout = exp(old_logp - rollout_logp) on the sampled token:
- "tis": truncated importance sampling — the policy-gradient term of each token is multiplied
  by the detached weight min(r, clip).
- "mis": masked importance sampling — tokens (or whole sequences) whose ratio lies outside
  [low, high] get weight 0 on the policy-gradient term, the others 1. `level`:
  "token" (r per token), "sequence" (the product of r over the response, i.e.
  exp(sum log r)), "geometric" (the geometric mean, exp(mean log r)).
- "bypass": π_rollout *is* the old policy: the PPO ratio is π / π_rollout and the trainer's
  old-log-prob pass is skipped (one forward pass fewer per step).
- "none": nothing is corrected (the mismatch is still measured).

Weights act on the per-token policy-gradient loss before aggregation; the normaliser (token
or sequence count of `loss_agg`) is the response mask's, so a masked token counts as a zero
loss, not as a missing one. All inputs are [B, T] aligned with the response mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mcore_rl.algorithms.advantages import masked_mean
from mcore_rl.algorithms.losses import kl_divergence
from mcore_rl.config import ConfigError

CORRECTION_MODES: tuple[str, ...] = ("none", "tis", "mis", "bypass")
MIS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
_MAX_LOG_RATIO = 20.0  # as in losses: exp() beyond this overflows


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """How the policy loss corrects for the engine's log-probs differing from the trainer's.

    mode: "none", "tis", "mis" or "bypass" (see `mcore_rl.algorithms.rollout_correction`).
    clip: tis — upper bound of the per-token weight min(π_old / π_rollout, clip) (> 0).
    level: mis — what the ratio is taken over: "token", "sequence" (product over the
        response) or "geometric" (geometric mean over the response).
    low / high: mis — ratios outside [low, high] are masked (0 <= low < high).
    """

    mode: Literal["none", "tis", "mis", "bypass"] = "none"
    clip: float = 2.0
    level: Literal["token", "sequence", "geometric"] = "token"
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ConfigError("mode", self.mode, f"allowed values: {', '.join(CORRECTION_MODES)}")
        if self.level not in MIS_LEVELS:
            raise ConfigError("level", self.level, f"allowed values: {', '.join(MIS_LEVELS)}")
        if not self.clip > 0:
            raise ConfigError("clip", self.clip, "must be > 0 (the largest TIS weight)")
        if self.low < 0:
            raise ConfigError("low", self.low, "must be >= 0")
        if not self.low < self.high:
            raise ConfigError(
                "high", self.high, f"must be > low={self.low} (MIS keeps ratios in [low, high])"
            )


def _log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """log(π_old / π_rollout) per token, 0 off the response."""
    diff = (old_logp.detach().float() - rollout_logp.detach().float()) * mask
    return diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def tis_weights(
    old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, clip: float
) -> Tensor:
    """min(π_old / π_rollout, clip) per token, detached; 0 off the response. [B, T]."""
    mask = response_mask.float()
    return torch.exp(_log_ratio(old_logp, rollout_logp, mask)).clamp(max=clip) * mask


def mis_mask(
    old_logp: Tensor,
    rollout_logp: Tensor,
    response_mask: Tensor,
    *,
    low: float,
    high: float,
    level: str = "token",
) -> Tensor:
    """1 where the ratio (per token, or of the token's whole response for the sequence
    levels) lies in [low, high], else 0; 0 off the response. [B, T]."""
    mask = response_mask.float()
    log_r = _log_ratio(old_logp, rollout_logp, mask)
    if level == "token":
        ratio = torch.exp(log_r)
    elif level == "sequence":
        ratio = torch.exp(log_r.sum(-1, keepdim=True).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    elif level == "geometric":
        ratio = torch.exp(log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
    else:
        raise ValueError(f"level={level!r}: allowed values: {', '.join(MIS_LEVELS)}")
    keep = ((ratio >= low) & (ratio <= high)).float()
    return keep.expand_as(mask) * mask


def correction_weights(
    cfg: RolloutCorrectionConfig, old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor
) -> tuple[Tensor | None, dict[str, float]]:
    """The per-token weights of the policy-gradient term (None: no weighting) and the step's
    mismatch metrics:
    mismatch/logprob_abs_diff  token mean of |old_logp - rollout_logp|
    mismatch/k3_kl             token mean of the k3 estimate of KL(π_rollout || π_old)
    mismatch/is_weight_mean    token mean of the weights applied (1 without weighting)
    mismatch/clipped_frac      tis: tokens whose ratio exceeded clip
    mismatch/masked_frac       mis: tokens masked out
    """
    mask = response_mask.float()
    old, rollout = old_logp.detach().float(), rollout_logp.detach().float()
    metrics = {
        "mismatch/logprob_abs_diff": float(masked_mean((old - rollout).abs(), mask)),
        "mismatch/k3_kl": float(masked_mean(kl_divergence(rollout, old, "k3"), mask)),
        "mismatch/clipped_frac": 0.0,
        "mismatch/masked_frac": 0.0,
    }
    weights = None
    if cfg.mode == "tis":
        weights = tis_weights(old, rollout, mask, clip=cfg.clip)
        ratio = torch.exp(_log_ratio(old, rollout, mask))
        metrics["mismatch/clipped_frac"] = float(masked_mean((ratio > cfg.clip).float(), mask))
    elif cfg.mode == "mis":
        weights = mis_mask(old, rollout, mask, low=cfg.low, high=cfg.high, level=cfg.level)
        metrics["mismatch/masked_frac"] = float(masked_mean(1.0 - weights, mask))
    metrics["mismatch/is_weight_mean"] = (
        1.0 if weights is None else float(masked_mean(weights, mask))
    )
    return weights, metrics


__all__ = [
    "CORRECTION_MODES",
    "MIS_LEVELS",
    "RolloutCorrectionConfig",
    "correction_weights",
    "mis_mask",
    "tis_weights",
]
