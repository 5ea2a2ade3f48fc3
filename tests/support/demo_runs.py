"""Shortened `mcore-rl demo` runs for the tests that check a demo learns (tests/run/)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys


def run_demo(tmp_path, *args: str) -> tuple[list[dict], list[dict]]:
    """(RL step metrics, warm-up metrics) of `mcore-rl demo ARGS --out tmp_path`."""
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", "demo", "--out", str(tmp_path),
                           *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def rows(name):
        path = tmp_path / name
        return ([json.loads(line) for line in path.read_text().splitlines()]
                if path.is_file() else [])  # no warm-up: no warm-up metrics

    # the RL steps' rows (an evaluation before the first step is a row of its own)
    return ([r for r in rows("metrics.jsonl") if "reward_mean" in r],
            rows("warmup_metrics.jsonl"))


def evaluations(run_dir) -> dict[int, dict]:
    """The rows of a run's metrics.jsonl that hold an evaluation, by step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "eval/reward_mean" in r}


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows)
