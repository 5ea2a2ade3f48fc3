"""The addition task: text format, exact-match reward, held-out split, noisy warm-up data."""

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.tasks import addition
from mcore_rl.tasks.addition import EOS_TEXT, AdditionTask, expected_answer, reward

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_format_and_answer():
    task = AdditionTask()
    assert task.prompt(37, 5) == "37+05=" and task.answer(37, 5) == "042"
    assert task.answer(99, 99) == "198" and expected_answer("37+05=") == "042"
    wide = AdditionTask(digits=3)
    assert wide.prompt(7, 993) == "007+993=" and wide.answer(7, 993) == "1000"
    assert expected_answer("007+993=") == "1000"


@pytest.mark.parametrize("response,want", [
    ("042" + EOS_TEXT, 1.0),           # exact answer then EOS
    ("042", 0.0),                      # right digits, stopped for length (no EOS)
    ("0421" + EOS_TEXT, 0.0),          # an extra token before EOS
    ("042" + EOS_TEXT + "0", 0.0),     # anything after EOS
    ("042<pad>" + EOS_TEXT, 0.0),      # a special token before EOS
    (" 042" + EOS_TEXT, 0.0),          # a space
    ("42" + EOS_TEXT, 0.0),            # not zero-padded to 3 digits
    ("043" + EOS_TEXT, 0.0),           # wrong digit
    (EOS_TEXT, 0.0),
    ("", 0.0),
])
def test_reward_is_exact_match_with_eos(response, want):
    assert reward("37+05=", response) == want


def test_reward_is_plain_module_function_and_rejects_foreign_prompts():
    assert addition.reward is reward and reward.__module__ == "mcore_rl.tasks.addition"
    assert reward("007+993=", "1000" + EOS_TEXT) == 1.0
    for bad in ("37+5=", "37+05", "a+b=", "<s>37+05="):
        with pytest.raises(ValueError, match="not an addition prompt"):
            reward(bad, "042" + EOS_TEXT)


def test_prompts_deterministic_and_split_disjoint():
    task = AdditionTask()
    assert task.prompts(64, seed=3) == task.prompts(64, seed=3)
    assert task.prompts(64, seed=3) != task.prompts(64, seed=4)
    heldout = set(task.heldout_prompts(256))
    assert len(heldout) == 256 and heldout == set(task.heldout_prompts(256))
    all_heldout = {task.prompt(a, b) for a in range(100) for b in range(100)
                   if task.is_heldout(a, b)}
    assert 800 < len(all_heldout) < 1200          # ~10 % of the 10,000 pairs
    assert heldout <= all_heldout
    train = {p for s in range(5) for p in task.prompts(2000, seed=s)}
    assert not train & all_heldout
    assert set(task.warmup_examples(500, seed=0, p=0.4)[i][0] for i in range(500)).isdisjoint(
        all_heldout)


def test_warmup_noise_rate():
    task = AdditionTask()
    clean = task.warmup_examples(2000, seed=1, p=0.0)
    assert all(ans == expected_answer(prompt) for prompt, ans in clean)
    noisy = task.warmup_examples(2000, seed=1, p=0.4)
    assert [p for p, _ in noisy] == [p for p, _ in clean]
    changed = sum(a != b for (_, x), (_, y) in zip(clean, noisy) for a, b in zip(x, y))
    rate = changed / (2000 * 3)
    assert abs(rate - 0.4 * 0.9) < 0.03            # a replacement digit equals the old 1/10
    assert all(len(a) == 3 and a.isdigit() for _, a in noisy)
    assert noisy == task.warmup_examples(2000, seed=1, p=0.4)


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="digits"):
        AdditionTask(digits=0)
    with pytest.raises(ConfigError, match="heldout_fraction"):
        AdditionTask(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="split"):
        AdditionTask().prompts(1, seed=0, split="test")
