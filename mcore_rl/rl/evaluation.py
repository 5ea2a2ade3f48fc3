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
from pathlib import Path

GENERATIONS_FILE = "generations.jsonl"


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
            from torch.utils.tensorboard import SummaryWriter  # lazy: torch

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


__all__ = ["GENERATIONS_FILE", "GenerationLog", "eval_metrics", "markdown_table", "pass_at_k"]
