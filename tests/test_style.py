"""Tools keep the style of the pure layers — the packages that compute configs, layouts,
plans and losses without starting a process: ruff's lint (pyflakes, pycodestyle, bugbear,
pyupgrade) and import order, ruff's formatter, and mypy's types (pyproject.toml holds each
tool's settings). Run them by hand with the commands in the assertion messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# linted and formatted
PURE = ["mcore_rl/config", "mcore_rl/parallel", "mcore_rl/algorithms", "mcore_rl/layouts",
        "mcore_rl/runconfig", "mcore_rl/planning", "mcore_rl/resharding/planner.py"]
# type-checked: the pure layers but the run's config and planning, whose "null = derived"
# fields are still typed Optional after the run is resolved (docs/design/architecture.md)
TYPED = [p for p in PURE if p not in ("mcore_rl/runconfig", "mcore_rl/planning")]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_ruff_lint_and_import_order_are_clean():
    proc = _run("ruff", "check", "--no-cache", *PURE)
    assert proc.returncode == 0, f"`.venv/bin/ruff check --fix {' '.join(PURE)}`:\n" + \
        proc.stdout[-4000:]


def test_ruff_format_is_applied():
    proc = _run("ruff", "format", "--check", "--no-cache", *PURE)
    assert proc.returncode == 0, f"`.venv/bin/ruff format {' '.join(PURE)}`:\n" + \
        proc.stdout[-4000:]


def test_mypy_finds_no_type_error():
    proc = _run("mypy", "--no-incremental", *TYPED)
    assert proc.returncode == 0, f"`.venv/bin/mypy {' '.join(TYPED)}`:\n" + proc.stdout[-4000:]
