"""Issue #43: a reward function that raises on a sample stops the run in one line naming the
sample, the step and the exception, with its own exit code (REWARD_FAILED_EXIT_CODE), after
the run loop checkpointed the last completed step (unless it already was)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mcore_rl.launch.exit_codes import REWARD_FAILED_EXIT_CODE
from mcore_rl.run import train
from mcore_rl.run.loop import run_steps
from mcore_rl.tasks.base import Example, RewardFailed


def reward_failed(step: int) -> RewardFailed:
    return RewardFailed(step=step, prompt_index=1, sample_index=3,
                        example=Example("q", "a", "data/train.jsonl:17"),
                        error=ValueError("cannot parse 'x'"))


class FakeController:
    """rl_step raises RewardFailed at `fails_at`; checkpoints are recorded (not written)."""

    def __init__(self, root: Path, fails_at: int):
        self.root, self.fails_at, self.saved = root, fails_at, []

    def rl_step(self, step):
        if step == self.fails_at:
            raise reward_failed(step)
        return {"reward_mean": float(step)}

    def save_checkpoint(self, step):
        self.saved.append(step)
        return self.root / f"step_{step}"


@pytest.mark.parametrize("first,every,saved,checkpoint", [
    (1, None, [2], "step_2"),   # step 2 completed, never checkpointed: written now
    (1, 2, [2], "step_2"),      # step 2 already checkpointed when due: not written again
    (1, 1, [1, 2], "step_2"),
    (3, None, [], None),        # resumed at the failing step: nothing completed here
])
def test_the_last_completed_step_is_checkpointed_before_the_failure_goes_on(
        tmp_path, first, every, saved, checkpoint):
    controller, recorded = FakeController(tmp_path, fails_at=3), []
    due = (lambda step: step % every == 0) if every else (lambda step: False)
    with pytest.raises(RewardFailed) as failed:
        run_steps(controller, range(first, 6), lambda step, m: recorded.append(step),
                  checkpoint_due=due)
    assert controller.saved == saved
    assert recorded == list(range(first, 3))  # the failed step records nothing
    assert failed.value.checkpoint == (None if checkpoint is None else tmp_path / checkpoint)


@pytest.mark.parametrize("checkpoint,tail", [
    (Path("/runs/x/checkpoints/step_2"), "the last completed step is checkpointed in "
                                         "/runs/x/checkpoints/step_2"),
    (None, "no step completed in this run (its checkpoints are as they were)"),
])
def test_train_prints_one_line_and_exits_with_its_code(monkeypatch, capsys, checkpoint, tail):
    def run_rl(cfg, out, resume, command):
        failed = reward_failed(3)
        failed.checkpoint = checkpoint
        raise failed

    monkeypatch.setattr(train, "run_rl", run_rl)
    args = argparse.Namespace(command="train", config=train.DEMO_CONFIG, overrides=[],
                              out=Path("unused"), resume="auto", verbose=False)
    assert train._run(args) == REWARD_FAILED_EXIT_CODE == 5
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("mcore-rl train: the reward function raised on step 3, prompt 1 "
                          "sample 3 (data/train.jsonl:17): ValueError: cannot parse 'x'; ")
    assert tail in err and "task.reward_errors: zero" in err
