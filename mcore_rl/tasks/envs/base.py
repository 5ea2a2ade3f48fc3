"""The environment API of multi-turn rollouts.

An environment is made per episode (one sampled response to one example) by a factory that the
task names by import path, as it names its reward function: `factory(example, reward_fn,
tool_format) -> Environment`, e.g. `mcore_rl.tasks.envs.tool_env:calculator_env` (`tool_format`: how
tool calls and results look for this tokenizer, `envs.tool_format`; environments without tools
ignore it). The rollout
(`mcore_rl.rollout.multi_turn`) then alternates:

    text = env.reset()                  the first observation: the prompt the model sees
    loop:  the model generates a turn   (its tokens are trained on: loss mask 1)
           step = env.step(turn_text)   reward, done, and the next observation (text or token
                                        ids), appended to the context, never trained on (mask 0)

until `done`, `EpisodeConfig.max_turns` model turns, or `EpisodeConfig.max_total_tokens`.
`turn_text` is the decoded turn with an ending EOS written as `tasks.addition.EOS_TEXT`
(`tasks.tokenizer.response_text`). The episode's reward is the sum of its steps' rewards.
Environments run in the controller process, between batched generation calls; `step` must not
block for long (tools bound their own work, see `mcore_rl.tasks.envs.tools`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mcore_rl.config import require_at_least
from mcore_rl.tasks.base import Example, RewardFn, load_by_path


@dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """Bounds of one multi-turn episode.

    max_turns: model turns at most (>= 1); an episode still running after them ends, and its
        last observation is not appended (no turn would read it).
    max_total_tokens: prompt + every model and observation token at most; each turn's
        `max_tokens` is cut to what is left, and an observation that does not fit (with room
        for one more model token) ends the episode. Must fit the trainer's rows
        (train.seq_len + 1) and the engines' max_model_len.
    """

    max_turns: int = 4
    max_total_tokens: int = 64

    def __post_init__(self) -> None:
        require_at_least(self, 1, "max_turns")
        require_at_least(self, 2, "max_total_tokens", note="a prompt token and a model token")


@dataclass(frozen=True)
class Step:
    """What an environment answers to one model turn.

    observation: text (tokenized without special tokens) or token ids to append before the next
        turn; None or empty when there is nothing to show. reward: this step's reward.
    done: the episode is over. tool_calls / tool_errors: tool calls this turn made, and how many
        of them became error observations (malformed, unknown tool, tool error, too long).
    """

    observation: str | list[int] | None
    reward: float
    done: bool
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    def reset(self) -> str:
        """The first observation: the prompt text (encoded as the task's prompts are)."""

    def step(self, turn: str) -> Step:
        """React to one model turn (decoded; EOS written as EOS_TEXT)."""


EnvFactory = Callable[["Example", "RewardFn", object], Environment]


def load_env_factory(path: str) -> EnvFactory:
    """"package.module:function" → the factory; it must accept (example, reward_fn,
    tool_format). Raises ValueError / ImportError / AttributeError naming what is wrong."""
    return load_by_path(path, (Example("p", "a"), lambda p, r, a: 0.0, None),
                        "(example, reward_fn, tool_format)")


__all__ = ["EnvFactory", "Environment", "EpisodeConfig", "Step", "load_env_factory"]
