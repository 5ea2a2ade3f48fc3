"""Sampling filters and reward shaping from DAPO (Yu et al., 2025, arXiv:2503.14476)."""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_sampling_keep(scores: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO dynamic sampling: indices of responses whose group's rewards are not all equal.

    scores: [B] outcome rewards; group_ids: [B] prompt id of each response. A group whose
    rewards are all equal (all correct, all wrong, or a group of size 1) has zero group-relative
    advantage and so gives no gradient; it is dropped. Equality is exact. Returns a sorted
    int64 tensor [K] of kept indices into the batch (the caller over-samples until the batch is
    full).
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    scores = scores.to(torch.float32)
    zeros = scores.new_zeros(n_groups)
    lo = zeros.scatter_reduce(0, inverse, scores, "amin", include_self=False)
    hi = zeros.scatter_reduce(0, inverse, scores, "amax", include_self=False)
    return torch.nonzero(lo[inverse] != hi[inverse]).flatten()


def overlong_penalty(
    response_lengths: Tensor,
    *,
    max_response_length: int,
    overlong_buffer: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO soft overlong punishment, to be added to each response's outcome reward.

    response_lengths: [B] valid response tokens. With L_max = max_response_length and
    L_buf = overlong_buffer, the penalty (DAPO eq. 13, scaled by `penalty_factor`) is
        0                              if |y| <= L_max - L_buf
        -(|y| - (L_max - L_buf)) / L_buf  if L_max - L_buf < |y| <= L_max  (linear 0 -> -1)
        -1                             if |y| > L_max
    times `penalty_factor`. Returns float [B]; all zeros when `overlong_buffer` is 0.
    """
    lengths = response_lengths.to(torch.float32)
    if overlong_buffer <= 0:
        return torch.zeros_like(lengths)
    expected = max_response_length - overlong_buffer
    frac = ((lengths - expected) / overlong_buffer).clamp(min=0.0, max=1.0)
    return -penalty_factor * frac


__all__ = ["dynamic_sampling_keep", "overlong_penalty"]
