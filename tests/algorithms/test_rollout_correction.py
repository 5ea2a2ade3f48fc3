"""Train–inference mismatch correction (TIS, MIS at three levels, the weighted policy loss)
against hand-computed values, and its config's errors."""

import math

import pytest
import torch

from mcore_rl.algorithms import (RolloutCorrectionConfig, correction_weights, mis_mask,
                                 policy_loss, tis_weights)
from mcore_rl.config import ConfigError, load_config
from tests.support import DEMO_SIZED

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32),
                               atol=atol, rtol=0)


# log(π_old / π_rollout) per token: row 0: +0.5, -1.0, 0.0; row 1: +1.0, +0.2, (masked)
OLD = t([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]])
ROLLOUT = t([[-1.5, -1.0, -0.5], [-2.0, -1.2, -1.0]])
MASK = t([[1, 1, 1], [1, 1, 0]])
E = math.e


def test_tis_weights_are_the_clamped_ratio():
    close(tis_weights(OLD, ROLLOUT, MASK, clip=2.0),
          [[E ** 0.5, E ** -1, 1.0], [2.0, E ** 0.2, 0.0]])  # e^1 = 2.72 clamped to 2


@pytest.mark.parametrize("level,low,high,expected", [
    # token ratios 1.65, 0.37, 1 | 2.72, 1.22: in [0.5, 2] are 1.65, 1, 1.22
    ("token", 0.5, 2.0, [[1, 0, 1], [0, 1, 0]]),
    # products: row 0 e^-0.5 = 0.61 (< 0.7: masked), row 1 e^1.2 = 3.32 (kept)
    ("sequence", 0.7, 4.0, [[0, 0, 0], [1, 1, 0]]),
    # geometric means: row 0 e^(-0.5/3) = 0.85 (kept), row 1 e^(1.2/2) = 1.82 (> 1.5: masked)
    ("geometric", 0.5, 1.5, [[1, 1, 1], [0, 0, 0]]),
])
def test_mis_masks(level, low, high, expected):
    close(mis_mask(OLD, ROLLOUT, MASK, low=low, high=high, level=level), expected)


def test_correction_metrics():
    weights, m = correction_weights(RolloutCorrectionConfig(mode="tis", clip=2.0), OLD, ROLLOUT,
                                    MASK)
    assert m["mismatch/logprob_abs_diff"] == pytest.approx((0.5 + 1 + 0 + 1 + 0.2) / 5)
    k3 = [math.exp(d) - d - 1 for d in (0.5, -1.0, 0.0, 1.0, 0.2)]  # d = old - rollout
    assert m["mismatch/k3_kl"] == pytest.approx(sum(k3) / 5, abs=1e-6)
    assert m["mismatch/clipped_frac"] == pytest.approx(1 / 5)
    assert m["mismatch/is_weight_mean"] == pytest.approx(float(weights.sum()) / 5)
    mask, m = correction_weights(RolloutCorrectionConfig(mode="mis", low=0.5, high=2.0), OLD,
                                 ROLLOUT, MASK)
    assert m["mismatch/masked_frac"] == pytest.approx(2 / 5)
    assert m["mismatch/is_weight_mean"] == pytest.approx(3 / 5)
    for mode in ("none", "bypass"):
        weights, m = correction_weights(RolloutCorrectionConfig(mode=mode), OLD, ROLLOUT, MASK)
        assert weights is None and m["mismatch/is_weight_mean"] == 1.0


def test_no_mismatch_means_no_correction():
    for cfg in (RolloutCorrectionConfig(mode="tis", clip=1.0),
                RolloutCorrectionConfig(mode="mis", low=0.99, high=1.01, level="sequence")):
        weights, m = correction_weights(cfg, OLD, OLD.clone(), MASK)
        close(weights, MASK)
        assert m["mismatch/masked_frac"] == 0 and m["mismatch/clipped_frac"] == 0


def test_policy_loss_with_tis_weights_is_the_weighted_loss():
    # per-token losses of test_losses._policy_inputs: -1.28, -0.5, 0.8, -1.25 | 3, 2.2
    old = t([[-1.0, -2.0, -0.5, -1.5], [-3.0, -1.0, -4.0, -4.0]])
    logp = (old + torch.log(t([[1.5, 0.5, 0.5, 1.25], [5.0, 1.1, 100.0, 100.0]])))
    logp.requires_grad_()
    adv, mask = t([[1.0, 1.0, -1.0, 1.0], [-1.0, -2.0, 5.0, 5.0]]), t([[1, 1, 1, 1], [1, 1, 0, 0]])
    weights = t([[2.0, 0.0, 1.0, 0.5], [0.0, 1.0, 5.0, 5.0]])
    loss, _ = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28,
                          clip_c=3.0, is_weights=weights)
    close(loss, (-1.28 * 2 + 0.8 - 1.25 * 0.5 + 2.2) / 6)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[1, 0] == 0  # weight-0 tokens get no gradient


@pytest.mark.parametrize("override,field,problem", [
    ("clip=0", "clip", "must be > 0"),
    ("clip=-1", "clip", "must be > 0"),
    ("low=2.0", "high", "must be > low=2.0"),
    ("low=-0.1", "low", "must be >= 0"),
    ("mode=is", "mode", "allowed values: none, tis, mis, bypass"),
    ("level=seq", "level", "allowed values: token, sequence, geometric"),
])
def test_bad_config_names_the_field(override, field, problem):
    from mcore_rl.runconfig import RLConfig

    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, DEMO_SIZED, [f"algorithm.rollout_correction.{override}"])
    assert err.value.field == f"algorithm.rollout_correction.{field}"
    assert problem in str(err.value)
