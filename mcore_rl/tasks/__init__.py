"""Tasks for RL: prompts with reference answers (`Task`, `Example`), built from a `TaskConfig`
(`build_task`), and rule reward functions `reward(prompt, response, answer) -> float`,
pluggable by import path (e.g. `mcore_rl.tasks.addition:reward`,
`mcore_rl.tasks.math:answer_reward`).
"""

from mcore_rl.tasks.addition import EOS_TEXT, AdditionTask, expected_answer, reward
from mcore_rl.tasks.base import Example, Task, load_reward_fn
from mcore_rl.tasks.config import TaskConfig, build_reward, build_task

__all__ = ["EOS_TEXT", "AdditionTask", "Example", "Task", "TaskConfig", "build_reward",
           "build_task", "expected_answer", "load_reward_fn", "reward"]
