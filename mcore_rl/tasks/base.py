"""What a task gives the RL loop: prompts with their reference answers, drawn by data position.

`Task` is the protocol the controller reads; reward functions are plain module-level functions
`reward(prompt, response, answer) -> float`, pluggable by import path ("module:function").

Data position: `train_examples(n, step=k, attempt=0, seed=s)` is a pure function of its
arguments, so a run resumed at step k draws exactly the examples an uninterrupted run would.
`attempt` numbers the extra draws of one step (dynamic sampling refills dropped groups).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

RewardFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class Example:
    """One prompt and its reference answer (text the reward function compares against)."""

    prompt: str
    answer: str


class Task(Protocol):
    def train_examples(self, n: int, *, step: int, attempt: int, seed: int) -> list[Example]:
        """`n` training examples at data position `step` (extra draw `attempt`)."""

    def heldout_examples(self, n: int, *, seed: int) -> list[Example]:
        """`n` evaluation examples, fixed for a given seed."""

    def warmup_examples(self, n: int, *, seed: int, p: float) -> list[tuple[str, str]]:
        """`n` supervised (prompt, target) pairs with label noise `p`; tasks without targets
        raise ValueError."""


def load_by_path(path: str, probe_args: tuple, accepts: str):
    """"package.module:function" → the function, checked to accept `probe_args` (`accepts`
    says how, for the message). Raises ValueError / ImportError / AttributeError naming what
    is wrong. Rewards and environments are named by import path this one way."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError("expected 'package.module:function'")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise ValueError(f"{path} is not callable")
    try:
        inspect.signature(fn).bind(*probe_args)
    except TypeError:
        raise ValueError(f"{path} must accept {accepts}") from None
    except ValueError:  # builtins without a signature: let the call decide
        pass
    return fn


def load_reward_fn(path: str) -> RewardFn:
    """"package.module:function" → the reward function; it must accept (prompt, response,
    answer)."""
    return load_by_path(path, ("prompt", "response", "answer"), "(prompt, response, answer)")


def no_reward(prompt: str, response: str, answer: str) -> float:
    """No rule reward (0): for runs rewarded by a reward model alone."""
    return 0.0


__all__ = ["Example", "RewardFn", "Task", "load_by_path", "load_reward_fn", "no_reward"]
