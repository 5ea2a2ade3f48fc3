"""Environments for multi-turn rollouts: the API (`Environment`, `Step`, `EpisodeConfig`,
factories by import path), the tag tool-call format, the built-in tools (a bounded `ast`
calculator, a table lookup) and the tool-using environment."""

from mcore_rl.tasks.envs.base import EnvFactory, Environment, EpisodeConfig, Step, load_env_factory
from mcore_rl.tasks.envs.tool_env import ToolEnv, calculator_env, tools_env
from mcore_rl.tasks.envs.tool_format import MalformedCall, TagFormat, ToolCall
from mcore_rl.tasks.envs.tools import BUILTIN_TOOLS, CalculatorLimits, ToolError, calculate, lookup

__all__ = ["BUILTIN_TOOLS", "CalculatorLimits", "EnvFactory", "Environment", "EpisodeConfig",
           "MalformedCall", "Step", "TagFormat", "ToolCall", "ToolEnv", "ToolError",
           "calculate", "calculator_env", "load_env_factory", "lookup", "tools_env"]
