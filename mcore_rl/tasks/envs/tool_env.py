"""A tool-using environment: each model turn either calls a tool (the result comes back as an
observation and the episode goes on) or answers (the episode ends and the task's reward
function scores the whole transcript).

Every bad call becomes an error observation, never an exception: a malformed call, an unknown
tool, a tool that refuses its input (`ToolError`) or fails in any other way, and a result
longer than `max_result_chars`. Factories for tasks (import paths):
`mcore_rl.tasks.envs.tool_env:calculator_env` (the calculator only) and
`mcore_rl.tasks.envs.tool_env:tools_env` (calculator and lookup).
"""

from __future__ import annotations

from collections.abc import Mapping

from mcore_rl.tasks.envs.base import Step
from mcore_rl.tasks.envs.tool_format import MalformedCall, TagFormat
from mcore_rl.tasks.envs.tools import BUILTIN_TOOLS, ToolError, ToolFn
from mcore_rl.tasks.base import Example, RewardFn

MAX_RESULT_CHARS = 64


class ToolEnv:
    """One episode. The transcript the reward sees is every model turn and observation text
    concatenated (what the model's context holds after the prompt)."""

    def __init__(self, example: Example, reward_fn: RewardFn, tools: Mapping[str, ToolFn], *,
                 fmt=TagFormat(), max_result_chars: int = MAX_RESULT_CHARS):
        self.example, self.reward_fn, self.tools, self.fmt = example, reward_fn, tools, fmt
        self.max_result_chars = max_result_chars
        self.transcript = ""

    def reset(self) -> str:
        self.transcript = ""
        return self.example.prompt

    def step(self, turn: str) -> Step:
        self.transcript += turn
        call = self.fmt.parse(turn)
        if call is None:  # an answer
            reward = float(self.reward_fn(self.example.prompt, self.transcript,
                                          self.example.answer))
            return Step(None, reward, True)
        observation, error = self._run(call)
        observation = self.fmt.error(observation) if error else self.fmt.result(observation)
        self.transcript += observation
        return Step(observation, 0.0, False, tool_calls=1, tool_errors=int(error))

    def _run(self, call) -> tuple[str, bool]:
        """(result text, False) or (error message, True)."""
        if isinstance(call, MalformedCall):
            return f"malformed call ({call.reason})", True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"unknown tool {call.name[:20]}", True
        try:
            result = str(tool(call.argument))
        except ToolError as err:
            return str(err), True
        except Exception as err:  # noqa: BLE001 — a broken tool must not end the run
            return f"tool failed ({type(err).__name__})", True
        if len(result) > self.max_result_chars:
            return f"result longer than {self.max_result_chars} characters", True
        return result, False


def calculator_env(example: Example, reward_fn: RewardFn, tool_format=None) -> ToolEnv:
    """The calculator (`calc`) only; tool_format None: the tag format."""
    return ToolEnv(example, reward_fn, {"calc": BUILTIN_TOOLS["calc"]},
                   fmt=tool_format or TagFormat())


def tools_env(example: Example, reward_fn: RewardFn, tool_format=None) -> ToolEnv:
    """Every built-in tool: `calc` and `lookup`; tool_format None: the tag format."""
    return ToolEnv(example, reward_fn, BUILTIN_TOOLS, fmt=tool_format or TagFormat())


__all__ = ["MAX_RESULT_CHARS", "ToolEnv", "calculator_env", "tools_env"]
