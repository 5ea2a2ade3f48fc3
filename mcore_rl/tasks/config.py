"""`TaskConfig`: which prompts an RL run trains on and how its responses are scored."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_rl.config import ConfigError
from mcore_rl.config.paths import code_ref, relative_to_config
from mcore_rl.tasks.addition import AdditionTask
from mcore_rl.tasks.base import RewardFn, Task, load_reward_fn
from mcore_rl.tasks.envs.base import EpisodeConfig, load_env_factory
from mcore_rl.tasks.jsonl import JsonlTask
from mcore_rl.tasks.tool_calc import ToolCalcTask

DEFAULT_REWARDS = {"addition": "mcore_rl.tasks.addition:reward",
                   "jsonl": "mcore_rl.tasks.math:answer_reward",
                   "tool_calc": "mcore_rl.tasks.tool_calc:reward"}
# kinds that are multi-turn by default, and their environment
DEFAULT_ENVS = {"tool_calc": "mcore_rl.tasks.envs.tool_env:calculator_env"}


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The task.

    kind: "addition" (the built-in fixed-width addition task, `mcore_rl.tasks.addition`),
        "jsonl" (prompts and reference answers from JSONL files, `mcore_rl.tasks.jsonl`) or
        "tool_calc" (multiplication with a calculator tool, multi-turn,
        `mcore_rl.tasks.tool_calc`).
    digits: addition and tool_calc — digits per operand.
    path: jsonl only — the training file (one JSON object per line). Read when the run
        starts, not when the config loads (a GPU config is checked on machines without data).
    heldout_path: jsonl only, optional — evaluation file (same keys).
    prompt_key / answer_key: jsonl only — the keys holding the prompt and the reference
        answer (GSM8K's "question" / "answer" by default). The prompt is text, or a list of
        chat messages ({"role", "content"}: system, user, assistant, tool), which is always
        rendered with the tokenizer's chat template (its generation prompt added); anything
        else (null, blank text, a number, an empty list, a malformed message) is refused
        naming the file and line. An answer that is not a string reaches the reward as its
        JSON text; a null one is refused.
    chat_template: render each text prompt as one user turn in the tokenizer's chat template
        (HF tokenizers that have one; the addition task's sentencepiece tokenizer has none).
        The reward function then receives the rendered text, as it does for a messages prompt.
    reward_fn: "module:function" or "path/to/file.py:function" (relative to the config file
        that sets it; on the command line, to the working directory) taking (prompt, response,
        answer) -> float, checked when the config loads; null: the kind's default (addition:
        mcore_rl.tasks.addition:reward, jsonl: mcore_rl.tasks.math:answer_reward, tool_calc:
        mcore_rl.tasks.tool_calc:reward). `prompt` is the text the engines encode (the
        rendered chat template for a messages prompt or with chat_template). In a multi-turn
        task the environment calls it on the whole transcript after the prompt.
    reward_errors: what a reward function that raises on a sample does: "raise" (the run
        stops naming the sample, its step and the exception, after checkpointing the last
        completed step) or "zero" (the sample scores 0; every step reports how many did as
        `reward/errors`).
    env: "module:factory" or "path/to/file.py:factory" (relative as reward_fn) of the
        environment that makes the task multi-turn (`mcore_rl.tasks.envs.base`:
        factory(example, reward_fn) -> Environment), e.g.
        mcore_rl.tasks.envs.tool_env:calculator_env; null: the kind's default (tool_calc: that
        calculator environment; addition and jsonl: single-turn). A multi-turn jsonl task
        takes text prompts only.
    episode: bounds of a multi-turn episode (turns, total tokens; see EpisodeConfig).
    overlong_prompts: what a prompt longer than the run's max_prompt_tokens (after
        tokenization, chat template included) does: "error" (the run stops, naming the row and
        its token count) or "filter" (jsonl: the row is dropped when the run starts, and the
        rows dropped are reported in every step's metrics as `prompts/filtered_overlong`).
        Never cut.
    """

    kind: Literal["addition", "jsonl", "tool_calc"] = "addition"
    digits: int = 2
    path: str | None = None
    heldout_path: str | None = None
    prompt_key: str = "question"
    answer_key: str = "answer"
    chat_template: bool = False
    reward_fn: str | None = field(default=None, metadata=relative_to_config(code_ref))
    reward_errors: Literal["raise", "zero"] = "raise"
    env: str | None = field(default=None, metadata=relative_to_config(code_ref))
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    overlong_prompts: Literal["error", "filter"] = "error"

    def __post_init__(self) -> None:
        if self.kind in ("addition", "tool_calc"):
            if self.kind == "addition":
                AdditionTask(digits=self.digits)  # raises ConfigError("digits", ...)
            else:
                ToolCalcTask(digits=self.digits)
            for name in ("path", "heldout_path"):
                if getattr(self, name) is not None:
                    raise ConfigError(name, getattr(self, name), 'only for kind "jsonl"')
            if self.chat_template:
                raise ConfigError("chat_template", True, f"the {self.kind} task's "
                                  "sentencepiece tokenizer has no chat template")
            if self.overlong_prompts == "filter":
                raise ConfigError("overlong_prompts", "filter", f"drops rows of a jsonl "
                                  f"dataset; the {self.kind} task's prompts are generated")
        elif not self.path:
            raise ConfigError("path", self.path, 'kind "jsonl" needs a JSONL file')
        if not self.prompt_key or not self.answer_key or self.prompt_key == self.answer_key:
            raise ConfigError("prompt_key", self.prompt_key,
                              f"prompt_key and answer_key must be two different non-empty keys "
                              f"(answer_key={self.answer_key!r})")
        try:
            load_reward_fn(self.reward_path)
        except (ImportError, AttributeError, ValueError) as err:
            raise ConfigError("reward_fn", self.reward_path, str(err)) from None
        if self.env_path is not None:
            try:
                load_env_factory(self.env_path)
            except (ImportError, AttributeError, ValueError) as err:
                raise ConfigError("env", self.env_path, str(err)) from None

    @property
    def env_path(self) -> str | None:
        """env, or the kind's default environment (None: single-turn)."""
        return self.env or DEFAULT_ENVS.get(self.kind)

    @property
    def multi_turn(self) -> bool:
        return self.env_path is not None

    @property
    def reward_path(self) -> str:
        """reward_fn, or the kind's default."""
        return self.reward_fn or DEFAULT_REWARDS[self.kind]

    @property
    def has_targets(self) -> bool:
        """Whether the task has supervised warm-up targets."""
        return self.kind in ("addition", "tool_calc")


def build_task(cfg: TaskConfig) -> Task:
    """The task of `cfg`; a jsonl task reads its files here (errors name file and line)."""
    if cfg.kind == "addition":
        return AdditionTask(digits=cfg.digits)
    if cfg.kind == "tool_calc":
        return ToolCalcTask(digits=cfg.digits)

    return JsonlTask(cfg.path, heldout_path=cfg.heldout_path, prompt_key=cfg.prompt_key,
                     answer_key=cfg.answer_key, chats=not cfg.multi_turn)


def build_reward(cfg: TaskConfig) -> RewardFn:
    """The reward function: called as reward(prompt, response, answer)."""
    return load_reward_fn(cfg.reward_path)


__all__ = ["DEFAULT_REWARDS", "TaskConfig", "build_reward", "build_task"]
