"""Advantage estimators against small hand-computed examples (numbers worked out in comments)."""

import math

import pytest
import torch

from mcore_rl.algorithms import (
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=0)


def test_outcome_reward_goes_on_last_valid_token():
    mask = t([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    close(outcome_to_token_rewards(t([1, 2, 3]), mask), [[0, 1, 0], [0, 0, 2], [0, 0, 0]])


def test_gae_hand_computed():
    gamma, lam = 0.9, 0.5  # gamma * lam = 0.45
    rewards = t([[0, 0, 1], [0, 5, 1], [0, 1, 0]])
    values = t([[1, 2, 3], [1, 9, 3], [1, 2, 7]])
    mask = t([[1, 1, 1], [1, 0, 1], [1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    # row 0: d2 = 1 - 3 = -2;          A2 = -2
    #        d1 = .9*3 - 2 = .7;        A1 = .7 + .45*(-2) = -.2
    #        d0 = .9*2 - 1 = .8;        A0 = .8 + .45*(-.2) = .71
    # row 1 (token 1 masked: its reward 5 and value 9 are skipped):
    #        A2 = -2;  d0 = .9*3 - 1 = 1.7;  A0 = 1.7 + .45*(-2) = .8
    # row 2 (token 2 is padding): d1 = 1 - 2 = -1; A1 = -1; d0 = .8; A0 = .8 - .45 = .35
    close(adv, [[0.71, -0.2, -2.0], [0.8, 0.0, -2.0], [0.35, -1.0, 0.0]])
    close(ret, [[1.71, 1.8, 1.0], [1.8, 0.0, 1.0], [1.35, 1.0, 0.0]])  # A + V on valid tokens


def test_gae_gamma_lam_one_is_monte_carlo_minus_value():
    rewards, values = t([[0.5, 0, 2]]), t([[1, 1, 1]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0,
                              whiten=False)
    close(ret, [[2.5, 2.0, 2.0]])  # rewards-to-go
    close(adv, [[1.5, 1.0, 1.0]])


def test_gae_whitened_over_valid_tokens_only():
    rewards, values = t([[0, 0, 1], [0, 1, 0]]), t([[1, 2, 3], [1, 2, 7]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, whiten=True)
    raw = t([0.71, -0.2, -2.0, 0.35, -1.0])  # from test_gae_hand_computed
    expected = (raw - raw.mean()) / raw.var(unbiased=False).sqrt()
    close(adv[mask.bool()], expected.tolist())
    assert adv[1, 2] == 0


def test_masked_whiten_single_token_is_zero():
    close(masked_whiten(t([[3.0, 7.0]]), t([[1, 0]])), [[0.0, 0.0]])


# groups (ids deliberately not contiguous): 7 -> [1, 0, 0, 1]; 3 -> [0.5] (size 1);
# 5 -> five times 0.1 (all equal); 9 -> [2, 4]
SCORES = [1, 0, 0, 1, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1, 2, 4]
GROUPS = [7, 7, 7, 7, 3, 5, 5, 5, 5, 5, 9, 9]


def _mask(lengths, width=3):
    return t([[1.0 if j < n else 0.0 for j in range(width)] for n in lengths])


def test_grpo_with_std():
    lengths = [3, 1, 2, 3, 3, 1, 2, 3, 3, 3, 2, 3]
    adv = grpo_advantages(t(SCORES), torch.tensor(GROUPS), _mask(lengths), eps=1e-6)
    # group 7: mean .5, unbiased std sqrt(4 * .25 / 3) = .57735 -> +-.5 / .57735 = +-.866025
    # group 9: mean 3, unbiased std sqrt(2) -> -+1 / 1.414214 = -+.707107
    per_seq = [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0, 0, 0, -0.707107, 0.707107]
    close(adv, [[a if j < n else 0.0 for j in range(3)] for a, n in zip(per_seq, lengths)])
    assert torch.all(adv[4:10] == 0)  # size-1 group and all-equal group: exactly zero


def test_grpo_without_std():
    adv = grpo_advantages(t(SCORES), torch.tensor(GROUPS), _mask([1] * 12, width=1),
                          norm_by_std=False)
    close(adv[:, 0], [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0, 0, -1, 1])


def test_rloo():
    scores = SCORES + [3, 0, 6]
    groups = GROUPS + [1, 1, 1]
    adv = rloo_advantages(t(scores), torch.tensor(groups), _mask([2] * 15, width=2))
    # group 7: 1 - (0+0+1)/3 = 2/3, 0 - 2/3 = -2/3;  group 9: 2 - 4, 4 - 2
    # group 1: 3 - 3 = 0, 0 - 4.5, 6 - 1.5
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0, 0, 0, -2, 2, 0, -4.5, 4.5]
    close(adv, [[a, a] for a in expected])
    assert torch.all(adv[4:10] == 0)


def test_discounted_returns_skip_masked_tokens():
    rewards = t([[1, 2, 4], [-0.1, -0.2, 1.0]])
    mask = t([[1, 0, 1], [1, 1, 1]])
    # row 0: G2 = 4; token 1 masked (reward 2 ignored); G0 = 1 + .5 * 4 = 3
    # row 1: G2 = 1; G1 = -.2 + .5 = .3; G0 = -.1 + .15 = .05
    close(discounted_returns(rewards, mask, gamma=0.5), [[3, 0, 4], [0.05, 0.3, 1.0]])


def test_reinforce_pp_returns_then_batch_whitening():
    rewards = t([[-0.1, -0.2, 1.0], [0.0, 0.5, 9.0]])  # outcome on last token + KL penalty
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    close(ret, [[0.7, 0.8, 1.0], [0.5, 0.5, 0.0]])
    # valid returns .7 .8 1 .5 .5: mean .7, population var (0 + .01 + .09 + .04 + .04) / 5
    # = .036, std .1897367 -> 0, .1/std, .3/std, -.2/std, -.2/std
    std = math.sqrt(0.036)
    close(adv, [[0.0, 0.1 / std, 0.3 / std], [-0.2 / std, -0.2 / std, 0.0]], atol=1e-4)


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages])
def test_group_estimators_handle_bool_mask_and_empty_rows(fn):
    mask = torch.tensor([[True, False], [False, False]])
    adv = fn(t([1.0, 0.0]), torch.tensor([0, 0]), mask)
    assert adv[0, 0] > 0 and adv[0, 1] == 0 and torch.all(adv[1] == 0)
