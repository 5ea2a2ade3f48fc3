"""What a task gives the RL loop: prompts with their reference answers, drawn by data position.

`Task` is the protocol the controller reads; reward functions are plain module-level functions
`reward(prompt, response, answer) -> float`, pluggable by import path ("module:function") or by
file ("path/to/file.py:function").

A prompt is text or a chat (`Chat`: a tuple of `Message`s, rendered by the tokenizer's chat
template, tasks/tokenizer.py); an `Example` may say where it came from (`source`, e.g.
"data/train.jsonl:17"), which an error about it names.

Data position: `train_examples(n, step=k, attempt=0, seed=s)` is a pure function of its
arguments, so a run resumed at step k draws exactly the examples an uninterrupted run would.
`attempt` numbers the extra draws of one step (dynamic sampling refills dropped groups).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Union

RewardFn = Callable[[str, str, str], float]

# the roles a chat prompt's messages may have
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    """One turn of a chat prompt, as HF chat templates read it: {"role": ..., "content": ...}."""

    role: str
    content: str


Chat = tuple[Message, ...]
Prompt = Union[str, Chat]


def chat_dicts(chat: Chat) -> list[dict[str, str]]:
    """A chat as the list of {"role", "content"} dicts `apply_chat_template` takes."""
    return [{"role": m.role, "content": m.content} for m in chat]


@dataclass(frozen=True)
class Example:
    """One prompt and its reference answer (text the reward function compares against).

    prompt: the prompt text, or a chat (`Chat`) that the tokenizer's chat template renders.
    source: where it came from, for messages about it (a jsonl row: "file:line"); not part
        of its identity (equal examples from two lines compare equal).
    """

    prompt: Prompt
    answer: str
    source: str | None = field(default=None, compare=False)

    def to_state(self) -> dict:
        """Plain values (`torch.load(weights_only=True)` reads them back): `from_state`."""
        prompt = self.prompt if isinstance(self.prompt, str) else chat_dicts(self.prompt)
        return {"prompt": prompt, "answer": self.answer, "source": self.source}

    @classmethod
    def from_state(cls, state) -> "Example":
        """`to_state`'s form, or the [prompt, answer] pair earlier checkpoints saved."""
        if not isinstance(state, dict):
            prompt, answer = state
            return cls(prompt, answer)
        prompt = state["prompt"]
        if not isinstance(prompt, str):
            prompt = tuple(Message(m["role"], m["content"]) for m in prompt)
        return cls(prompt, state["answer"], state.get("source"))


class RewardFailed(RuntimeError):
    """The reward function raised on a sample. The message is one line naming the sample (its
    source, e.g. "data.jsonl:17", or its prompt), the step, the sample's place in the step and
    the exception; `error` is the exception. `checkpoint`: the checkpoint of the last step
    completed before it, once the run loop has written it (None: no step completed)."""

    def __init__(self, *, step: int, prompt_index: int, sample_index: int, example: Example,
                 error: BaseException):
        self.step, self.prompt_index, self.sample_index = step, prompt_index, sample_index
        self.example, self.error = example, error
        self.checkpoint = None
        where = example.source or f"prompt {describe_prompt(example.prompt)}"
        text = " ".join(str(error).split())
        super().__init__(f"the reward function raised on step {step}, prompt {prompt_index} "
                         f"sample {sample_index} ({where}): {type(error).__name__}: "
                         f"{text[:300] + '...' if len(text) > 300 else text}")


def describe_prompt(prompt: Prompt, width: int = 60) -> str:
    """A short one-line view of a prompt, for messages."""
    text = prompt if isinstance(prompt, str) else " | ".join(
        f"{m.role}: {m.content}" for m in prompt)
    text = " ".join(text.split())
    return repr(text if len(text) <= width else text[:width] + "...")


class Task(Protocol):
    def train_examples(self, n: int, *, step: int, attempt: int, seed: int) -> list[Example]:
        """`n` training examples at data position `step` (extra draw `attempt`)."""

    def heldout_examples(self, n: int, *, seed: int) -> list[Example]:
        """`n` evaluation examples, fixed for a given seed."""

    def warmup_examples(self, n: int, *, seed: int, p: float) -> list[tuple[str, str]]:
        """`n` supervised (prompt, target) pairs with label noise `p`; tasks without targets
        raise ValueError."""


def load_by_path(path: str, probe_args: tuple, accepts: str):
    """"package.module:function" or "path/to/file.py:function" → the function, checked to
    accept `probe_args` (`accepts` says how, for the message). A file path is taken as it is
    (relative: to the working directory; the config loader makes a config's own paths
    absolute, `mcore_rl.config.paths`); the file is loaded as a module of its own, once per
    process, without touching sys.path. Raises ValueError / ImportError / AttributeError,
    each one line naming what is wrong. Rewards and environments are named this one way."""
    module, sep, name = path.rpartition(":")
    if not sep or not module or not name:
        raise ValueError("expected 'package.module:function' or 'path/to/file.py:function'")
    if module.endswith(".py") or "/" in module:
        loaded, where = _load_file(Path(module)), module
    else:
        try:
            loaded, where = importlib.import_module(module), f"module {module}"
        except ImportError:
            raise
        except Exception as err:  # the module raised while it was imported
            raise ImportError(f"importing {module} raised {_one_line(err)}") from None
    fn = getattr(loaded, name, None)
    if fn is None:
        raise AttributeError(f"{where} has no attribute {name!r}")
    if not callable(fn):
        raise ValueError(f"{path} is not callable")
    try:
        inspect.signature(fn).bind(*probe_args)
    except TypeError:
        raise ValueError(f"{path} must accept {accepts}") from None
    except ValueError:  # builtins without a signature: let the call decide
        pass
    return fn


def _load_file(path: Path):
    """The Python file at `path` as a module (loaded once per process: the same file is the
    same module, whichever path names it)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ImportError(f"{path}: no such file")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"mcore_rl_user_code_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[name]
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise ImportError(f"{path}: loading it raised {_one_line(err)}") from None
    return module


def _one_line(err: BaseException) -> str:
    where = f" (line {err.lineno})" if isinstance(err, SyntaxError) and err.lineno else ""
    return f"{type(err).__name__}: {' '.join(str(err).split())}{where}"


def load_reward_fn(path: str) -> RewardFn:
    """"package.module:function" or "path/to/file.py:function" → the reward function; it must
    accept (prompt, response, answer)."""
    return load_by_path(path, ("prompt", "response", "answer"), "(prompt, response, answer)")


def no_reward(prompt: str, response: str, answer: str) -> float:
    """No rule reward (0): for runs rewarded by a reward model alone."""
    return 0.0


__all__ = ["ROLES", "Chat", "Example", "Message", "Prompt", "RewardFailed", "RewardFn", "Task",
           "chat_dicts", "describe_prompt", "load_by_path", "load_reward_fn", "no_reward"]
