"""A test environment that makes every episode multi-turn whatever the (untrained) model says:
turns 1 and 2 get a fixed observation, turn 3 ends the episode with a reward that differs
between samples (so GRPO groups carry a gradient)."""

from mcore_rl.tasks.envs.base import Step

OBSERVATION = "<result>4321</result>"


class ThreeTurns:
    def __init__(self, example, reward_fn, tool_format):
        self.example, self.turns = example, 0

    def reset(self):
        return self.example.prompt

    def step(self, turn):
        self.turns += 1
        if self.turns < 3:
            return Step(OBSERVATION, 0.0, False, tool_calls=1, tool_errors=self.turns - 1)
        return Step(None, float(len(turn) % 2), True)


def three_turn_env(example, reward_fn, tool_format):
    return ThreeTurns(example, reward_fn, tool_format)
