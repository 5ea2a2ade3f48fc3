"""Synthetic verifiable tasks (prompts, held-out splits, reward functions) and their tokenizers.

Reward functions are plain module-level functions `reward(prompt_text, response_text) -> float`,
pluggable by import path (e.g. `mcore_rl.tasks.addition:reward`).
"""

from mcore_rl.tasks.addition import EOS_TEXT, AdditionTask, expected_answer, reward

__all__ = ["EOS_TEXT", "AdditionTask", "expected_answer", "reward"]
