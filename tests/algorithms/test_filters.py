"""DAPO dynamic sampling and overlong shaping against hand-computed examples."""
import pytest

import torch

from mcore_rl.algorithms import dynamic_sampling_keep, overlong_penalty

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_dynamic_sampling_keeps_groups_with_reward_spread():
    scores = torch.tensor([1, 0, 1, 1, 0.5, 0, 0, 0, 2, 3, 2])
    groups = torch.tensor([4, 4, 1, 1, 2, 0, 0, 0, 9, 9, 9])
    # group 4 mixed -> keep; 1 all 1 -> drop; 2 size 1 -> drop; 0 all 0 -> drop; 9 mixed -> keep
    assert dynamic_sampling_keep(scores, groups).tolist() == [0, 1, 8, 9, 10]


def test_dynamic_sampling_all_dropped():
    assert dynamic_sampling_keep(torch.ones(4), torch.tensor([0, 0, 1, 1])).numel() == 0


def test_overlong_penalty_ramp():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # L_max 20, buffer 4: free up to 16, then -(len - 16) / 4, capped at -1; times 0.5
    out = overlong_penalty(lengths, max_response_length=20, overlong_buffer=4,
                           penalty_factor=0.5)
    assert out.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def test_overlong_penalty_off_without_buffer():
    out = overlong_penalty(torch.tensor([5, 50]), max_response_length=20, overlong_buffer=0)
    assert out.tolist() == [0.0, 0.0]
