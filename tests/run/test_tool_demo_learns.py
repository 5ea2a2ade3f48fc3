"""The multi-turn tool demo learns: a shortened run of `mcore-rl demo --task tool_calc` whose
reward must rise by calling the calculator more, and whose tool-error rate must not grow.

It guards the learning dynamics, which the unit tests of the loss, the masks and the engine's
log-probs cannot: the tool demo once stopped learning while every mechanical check passed (its
warm-up stopped on greedy accuracy, leaving sampled rewards at ~0.5 %; a change of summation
order in the warm-up then decided whether the first few rewarded samples pulled RL up or
pushed it into malformed calls). No held-out evaluation: it only measures the weights and
never changes what is trained."""

from __future__ import annotations

import pytest

from tests.support.demo_runs import mean, run_demo

# an end-to-end CLI run that loads every core: run apart from the other such files on the
# parallel workers (tests/support/scheduling.py's WHOLE_MACHINE)
pytestmark = pytest.mark.slow


def test_tool_demo_learns_to_call_and_copy(tmp_path):
    steps, warmup = run_demo(tmp_path, "--task", "tool_calc", "steps=16", "eval.every=0")
    assert [r["step"] for r in steps] == list(range(1, 17))
    # the warm-up stopped on the accuracy RL samples (T=1), so RL starts with a signal
    assert warmup[-1]["accuracy"] >= 0.05, warmup[-1]
    first, last = steps[:3], steps[-5:]
    # reward rises (when the warm-up stopped on greedy accuracy: 0.005 -> 0.000 on this seed)
    assert mean(last, "reward_mean") >= mean(first, "reward_mean") + 0.25, \
        [r["reward_mean"] for r in steps]
    # ... by calling the calculator well: more calls, no more of them failing
    assert mean(last, "tool_calls/mean") > mean(first, "tool_calls/mean")
    assert mean(last, "tool_errors/frac") <= mean(first, "tool_errors/frac"), \
        [r["tool_errors/frac"] for r in steps]
    # from the first step, groups whose samples differ in reward carry the gradient
    assert mean(first, "informative_groups_frac") >= 0.1, first
    assert max(r["rollout_logprob_max_diff"] for r in steps) < 1e-4
