"""Math rewards on hand-worked responses: the final answer (#### > \\boxed{} > last number),
number normalisation, GSM8K-solution references, and the format check."""

from __future__ import annotations

import pytest

from mcore_rl.tasks.math import (
    answer_reward,
    final_answer,
    format_reward,
    normalize,
    reference_answer,
)

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

GSM8K_REF = "Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72"


@pytest.mark.parametrize("response,expected", [
    ("48 + 24 = 72\n#### 72", "72"),
    ("#### 72\nthen 5 more words 9", "72"),                  # marker beats the last number
    ("so \\boxed{72} and later 3", "72"),                    # boxed beats the last number
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),               # nested braces kept
    ("first 10, then 1,250.50 dollars", "1,250.50"),          # last number, commas kept raw
    ("no numbers here", None),
    ("answer \\boxed{7", "7"),                                # unclosed box: last number
    ("#### 5 #### 6", "6"),                                   # the last marker
    ("The answer is 72</s>", "72"),                           # EOS text ignored
])
def test_final_answer(response, expected):
    assert final_answer(response) == expected


@pytest.mark.parametrize("raw,expected", [
    ("72", "72"), ("72.0", "72"), ("72.", "72"), ("1,000", "1000"), ("$1,000.00", "1000"),
    ("0.50", "0.5"), (".5", "0.5"), ("-3", "-3"), ("$ 18", "18"), ("72 clips", "72"),
    ("x + 1", "x + 1"), ("  ", None),
])
def test_normalize(raw, expected):
    assert normalize(raw) == expected


def test_reference_answer():
    assert reference_answer(GSM8K_REF) == "72"
    assert reference_answer(" 42 ") == "42"


@pytest.mark.parametrize("response,reward", [
    ("She sold 24 in May, 72 in total.\n#### 72", 1.0),
    ("#### 72.0", 1.0),
    ("The total is \\boxed{72}.", 1.0),
    ("24 + 48 = 72", 1.0),                                    # last number, no marker
    ("#### 71", 0.0),
    ("#### 72 apples? no: #### 70", 0.0),                     # the last stated answer counts
    ("I think it is 72, or maybe 73", 0.0),
    ("", 0.0),
])
def test_answer_reward_gsm8k_reference(response, reward):
    assert answer_reward("prompt", response, GSM8K_REF) == reward


def test_answer_reward_plain_references():
    assert answer_reward("", "#### $1,200", "1200") == 1.0
    assert answer_reward("", "\\boxed{0.5}", "1/2") == 0.0   # fractions are not evaluated
    assert answer_reward("", "\\boxed{x+1}", "x + 1") == 0.0   # text compares whitespace-split
    assert answer_reward("", "\\boxed{x + 1}", "x + 1") == 1.0
    with pytest.raises(ValueError, match="empty"):
        answer_reward("", "#### 1", "  ")


@pytest.mark.parametrize("response,reward", [
    ("#### 72", 1.0), ("\\boxed{3.5}", 1.0), ("#### $1,000", 1.0),
    ("the answer is 72", 0.0),                                # no explicit final answer
    ("#### many", 0.0), ("\\boxed{}", 0.0), ("\\boxed{1 and 2}", 0.0),
])
def test_format_reward(response, reward):
    assert format_reward("p", response, "72") == reward
    assert format_reward("p", response) == reward             # the answer is not needed
