"""Evaluation during RL, and generations a person can read.

Every `eval.every` steps (and before the first, `eval.before_train`) the engines, holding the
weights just synced, answer the run's held-out prompts — `task.heldout_path` for a jsonl
task, the task's own held-out split for the built-in ones — and the step's metrics get
`eval/reward_mean`, `eval/pass@1` (and `eval/pass@k` for k = eval.samples_per_prompt > 1),
`eval/response_length` and `eval/prompts`. The held-out prompts are the same at every
evaluation, and so are the samples' seeds (stream "eval"), so two evaluations differ only by
the weights.

Every `logging.generations.every` steps a few of the step's samples (prompt, response,
reward, answer) are appended to RUN_DIR/generations.jsonl and shown in TensorBoard's text tab
(RUN_DIR/tb/generations); each evaluation adds a few of its own (`"kind": "eval"`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from mcore_rl.config import require_at_least

GENERATIONS_FILE = "generations.jsonl"


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation during RL on held-out prompts (rl/evaluation.py): `task.heldout_path` for a
    jsonl task (no file: no evaluation, and preflight says so), the held-out split of the
    built-in tasks.

    every: evaluate after every this many RL steps, and after the last (0: never).
    before_train: also evaluate the starting weights, before the first RL step (as step 0).
    max_prompts: held-out prompts per evaluation at most (the same ones every time).
    samples_per_prompt: k; with k > 1, `eval/pass@k` beside `eval/pass@1`.
    temperature: 0 = greedy (then k > 1 samples are all alike: raise it for pass@k).
    pass_threshold: a sample passes when its reward is at least this (exact-match rewards
        give 1 or 0).
    """

    every: int = 10
    before_train: bool = True
    max_prompts: int = 256
    samples_per_prompt: int = 1
    temperature: float = 0.0
    pass_threshold: float = 1.0

    def __post_init__(self) -> None:
        require_at_least(self, 0, "every", "temperature")
        require_at_least(self, 1, "max_prompts", "samples_per_prompt")

    def due(self, step: int, last_step: int) -> bool:
        """Whether an evaluation follows RL step `step` (0: before the first)."""
        if not self.every:
            return False
        if step == 0:
            return self.before_train
        return step % self.every == 0 or step == last_step


@dataclass(frozen=True, kw_only=True)
class GenerationsConfig:
    """Readable samples in RUN_DIR/generations.jsonl and TensorBoard's text tab.

    every: after every this many RL steps (0: never), `samples` of the step's samples (the
        first sample of each of its first prompts); each evaluation adds `samples` of its own.
    """

    every: int = 10
    samples: int = 4

    def __post_init__(self) -> None:
        require_at_least(self, 0, "every", "samples")

    def due(self, step: int) -> bool:
        return bool(self.every and self.samples) and step % self.every == 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c of n samples passing (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(scores: list[list[float]], lengths: list[list[int]], *,
                 threshold: float) -> dict[str, float]:
    """An evaluation's metrics from each prompt's samples' rewards and response lengths."""
    k = len(scores[0])
    flat = [s for group in scores for s in group]
    passes = [sum(s >= threshold for s in group) for group in scores]
    metrics = {"eval/reward_mean": sum(flat) / len(flat),
               "eval/pass@1": sum(pass_at_k(k, c, 1) for c in passes) / len(scores),
               "eval/response_length": sum(map(sum, lengths)) / len(flat),
               "eval/prompts": float(len(scores))}
    if k > 1:
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(k, c, k) for c in passes) / len(scores)
    return metrics


class GenerationLog:
    """Appends readable samples to RUN_DIR/generations.jsonl, one object per sample (step,
    kind "train" or "eval", prompt, response, reward, answer), and to TensorBoard's text tab
    (RUN_DIR/tb/generations, a table per step and kind). The TensorBoard writer starts with
    the first record."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / GENERATIONS_FILE
        self.tb_dir = Path(run_dir) / "tb" / "generations"
        self._tb = None

    def write(self, step: int, kind: str, records: list[dict]) -> None:
        if not records:
            return
        with self.path.open("a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({"step": step, "kind": kind, **record},
                                   ensure_ascii=False) + "\n")
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.tb_dir))
        self._tb.add_text(f"generations/{kind}", markdown_table(records), step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def markdown_table(records: list[dict]) -> str:
    """The records as a markdown table (TensorBoard renders its text tab as markdown)."""
    def cell(value) -> str:
        text = value if isinstance(value, str) else json.dumps(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    keys = ("prompt", "response", "reward", "answer")
    rows = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    rows += ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in records]
    return "\n".join(rows)


__all__ = ["EvalConfig", "GENERATIONS_FILE", "GenerationLog", "GenerationsConfig",
           "eval_metrics", "markdown_table", "pass_at_k"]
