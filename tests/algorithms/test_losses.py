"""Policy / value / entropy / KL losses against hand-computed examples."""

import math

import pytest
import torch

from mcore_rl.algorithms import (
    aggregate_loss,
    entropy_bonus,
    kl_divergence,
    kl_loss,
    kl_penalty_rewards,
    log_probs_and_entropy,
    policy_loss,
    value_loss,
)

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32),
                               atol=atol, rtol=0)


# Tokens (ratio r, advantage A) with eps_low .2, eps_high .28, clip_c 3; per-token loss:
#   a: r 1.5,  A +1: max(-1.5, -1.28) = -1.28    (upper clip)
#   b: r 0.5,  A +1: max(-0.5, -0.8)  = -0.5     (unclipped, pessimistic side)
#   c: r 0.5,  A -1: max(0.5, 0.8)    =  0.8     (lower clip)
#   f: r 1.25, A +1: max(-1.25, -1.25) = -1.25   (inside 1 + .28; symmetric .2 would clip to -1.2)
#   d: r 5.0,  A -1: max(5, 1.28) = 5 -> min(5, 3) = 3    (dual-clip)
#   e: r 1.1,  A -2: 2.2, dual bound 6 not active
#   x: r 100,  A +5: masked out
RATIOS = [[1.5, 0.5, 0.5, 1.25], [5.0, 1.1, 100.0, 100.0]]
ADV = [[1.0, 1.0, -1.0, 1.0], [-1.0, -2.0, 5.0, 5.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0]]


def _policy_inputs():
    old = t([[-1.0, -2.0, -0.5, -1.5], [-3.0, -1.0, -4.0, -4.0]])
    logp = (old + torch.log(t(RATIOS))).requires_grad_()
    return logp, old, t(ADV), t(MASK)


@pytest.mark.parametrize("agg,expected", [
    ("token-mean", 2.97 / 6),                               # (-2.23 + 5.2) / 6 tokens
    ("seq-mean-token-mean", (-2.23 / 4 + 5.2 / 2) / 2),     # row means -.5575 and 2.6
    ("seq-mean-token-sum", (-2.23 + 5.2) / 2),
])
def test_policy_loss_dual_clip_asymmetric(agg, expected):
    logp, old, adv, mask = _policy_inputs()
    loss, metrics = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28,
                                clip_c=3.0, agg=agg)
    close(loss, expected)
    close(metrics["pg_clipfrac"], 2 / 6)        # a and c
    close(metrics["pg_clipfrac_lower"], 1 / 6)  # d
    valid_ratios = [1.5, 0.5, 0.5, 1.25, 5.0, 1.1]
    close(metrics["ppo_kl"], -sum(math.log(r) for r in valid_ratios) / 6)


def test_policy_loss_without_dual_clip_and_symmetric():
    logp, old, adv, mask = _policy_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, (2.97 - 3.0 + 5.0) / 6)  # d back to 5
    loss, _ = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, clip_c=3.0)
    close(loss, (2.97 + 0.08 + 0.05) / 6)  # a: -1.28 -> -1.2, f: -1.25 -> -1.2


def test_policy_loss_gradient_only_through_unclipped_tokens():
    logp, old, adv, mask = _policy_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28,
                          clip_c=3.0)
    loss.backward()
    # d(-A r)/d logp = -A r; clipped (a, c), dual-clipped (d) and masked (x) tokens get 0; / 6
    close(logp.grad, [[0.0, -0.5 / 6, 0.0, -1.25 / 6], [0.0, 2.2 / 6, 0.0, 0.0]])


def test_ppo_step_raises_probability_of_positive_advantage_tokens():
    torch.manual_seed(0)
    logits = torch.nn.Parameter(torch.randn(4, 8))
    target = torch.tensor([1, 2, 3, 4])
    adv = t([[2.0, 1.0, -1.0, -2.0]])
    mask = torch.ones(1, 4)
    before, _ = log_probs_and_entropy(logits.detach(), target)
    logp, _ = log_probs_and_entropy(logits, target)
    loss, _ = policy_loss(logp[None], before[None], adv, mask)
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    after, _ = log_probs_and_entropy(logits.detach(), target)
    assert torch.all((after - before)[:2] > 0) and torch.all((after - before)[2:] < 0)


def test_aggregate_loss_skips_empty_rows():
    loss, mask = t([[1, 2], [5, 5]]), t([[1, 1], [0, 0]])
    close(aggregate_loss(loss, mask, "token-mean"), 1.5)
    close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 1.5)
    close(aggregate_loss(loss, mask, "seq-mean-token-sum"), 3.0)
    close(aggregate_loss(loss, torch.zeros(2, 2), "token-mean"), 0.0)
    with pytest.raises(ValueError, match="allowed values"):
        aggregate_loss(loss, mask, "sum")


def test_entropy_bonus():
    ent, mask = t([[1, 2], [3, 9]]), t([[1, 1], [1, 0]])
    loss, metrics = entropy_bonus(ent, mask, coeff=0.01)
    close(loss, -0.01 * 6 / 3)
    close(metrics["entropy"], 2.0)
    loss, _ = entropy_bonus(ent, mask, coeff=0.01, agg="seq-mean-token-mean")
    close(loss, -0.01 * (1.5 + 3) / 2)


def test_value_loss_clipped():
    values = t([[1.0, 1.0, 0.2, 100.0]]).requires_grad_()
    old, returns, mask = t([[0, 0, 0, 0]]), t([[2, 0, 1, 0]]), t([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.5)
    # t0: max((1-2)^2, (.5-2)^2) = 2.25 (clipped) -> 1.125; t1: max(1, .25) -> .5; t2: .64 -> .32
    close(loss, (1.125 + 0.5 + 0.32) / 3)
    close(metrics["vf_clipfrac"], 1 / 3)
    loss.backward()
    close(values.grad, [[0.0, 1.0 / 3, -0.8 / 3, 0.0]])  # clipped t0 has no gradient
    loss, _ = value_loss(values, old, returns, mask, clip=None)
    close(loss, (0.5 + 0.5 + 0.32) / 3)


LN2 = math.log(2.0)


@pytest.mark.parametrize("estimator,expected", [
    # d = ref - logp = [-ln2, ln2]
    ("k1", [LN2, -LN2]),
    ("k2", [LN2**2 / 2, LN2**2 / 2]),
    ("k3", [0.5 + LN2 - 1, 2 - LN2 - 1]),  # exp(d) - d - 1
])
def test_kl_estimators(estimator, expected):
    logp, ref = torch.log(t([0.5, 0.25])), torch.log(t([0.25, 0.5]))
    close(kl_divergence(logp, ref, estimator), expected)


def test_k3_is_clamped():
    close(kl_divergence(t([0.0, 0.0]), t([15.0, -1e4]), "k3"), [10.0, 10.0])


def test_kl_loss_value_and_gradient():
    logp = torch.log(t([[0.5, 0.25]])).requires_grad_()
    ref = torch.log(t([[0.25, 0.5]]))
    loss, metrics = kl_loss(logp, ref, torch.ones(1, 2), coeff=0.1, estimator="k3")
    close(loss, 0.1 * 0.5 / 2)  # k3 values .193147 + .306853 = .5
    close(metrics["kl"], 0.25)
    loss.backward()
    close(logp.grad, [[0.1 / 2 * (1 - 0.5), 0.1 / 2 * (1 - 2.0)]])  # d k3/d logp = 1 - exp(d)


def test_kl_penalty_folded_into_rewards():
    scores = t([[0, 0, 1], [0, 2, 0]])
    ref = torch.zeros(2, 3)
    logp = t([[0.1, 0.2, -0.1], [0.3, 0.0, 5.0]])  # k1 = logp - ref
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards, metrics = kl_penalty_rewards(scores, logp, ref, mask, coeff=0.5, estimator="k1")
    close(rewards, [[-0.05, -0.1, 1.05], [-0.15, 2.0, 0.0]])
    close(metrics["kl"], 0.1)
    assert not rewards.requires_grad
