"""`mcore-rl train-lm` end to end: spawns its 2 TP ranks, prints a line per step, and the
synthetic task's loss falls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_train_lm_runs_and_learns():
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train-lm", "--config",
         str(ROOT / "configs" / "lm_micro.yaml"), "steps=10"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step +\d+/10 +loss +([\d.]+)", proc.stdout, re.M)]
    assert len(losses) == 10, proc.stdout
    assert losses[-1] < losses[0] - 1.0, losses  # 5.57 -> ~3.0 in 10 steps


def test_train_lm_reports_config_errors():
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train-lm", "--config",
         str(ROOT / "configs" / "lm_micro.yaml"), "actor.tp=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "actor.tp=3: does not divide num_attention_heads=4" in proc.stderr
