"""The suite's durations report and CI's budget per test file (tests/support/durations.py)."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys
from pathlib import Path

from tests.support.durations import file_of, over_budget

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

ROOT = Path(__file__).resolve().parents[1]


def test_files_over_the_budget_are_named_slowest_first():
    seconds = {"tests/a.py": 30.0, "tests/b.py": 150.0, "tests/c.py": 121.0}
    assert over_budget(seconds, 120) == [("tests/b.py", 150.0), ("tests/c.py", 121.0)]
    assert over_budget(seconds, None) == []
    assert file_of("tests/rl/test_x.py::test_y[a-b]") == "tests/rl/test_x.py"


def test_a_file_over_the_budget_fails_the_run_and_is_named(tmp_path):
    """A passing file over the budget fails the run (exit 1) with its time in the report;
    within the budget it passes."""
    test = tmp_path / "tests" / "test_slow.py"
    test.parent.mkdir()
    test.write_text("import time\n\ndef test_slow():\n    time.sleep(0.3)\n")
    (tmp_path / "tests" / "conftest.py").write_text(
        "from tests.support.durations import (pytest_runtest_logreport, pytest_sessionfinish,"
        " pytest_terminal_summary)  # noqa: F401\n")

    def run(budget: str):
        env = {**os.environ, "MCORE_RL_FILE_BUDGET_S": budget, "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "--rootdir", str(tmp_path), str(test)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    over, within = run("0.1"), run("60")
    assert over.returncode == 1, over.stdout[-2000:]
    assert "1 passed" in over.stdout
    assert "OVER BUDGET: tests/test_slow.py took 0." in over.stdout, over.stdout[-2000:]
    assert within.returncode == 0, within.stdout[-2000:]
    assert "OVER BUDGET" not in within.stdout and "tests/test_slow.py" in within.stdout


def test_the_fast_tier_covers_every_package():
    """`-m fast` (README: Development) runs at least one test of every mcore_rl package: a
    file of tests/<package>/ marked fast as a whole or in one of its tests."""
    packages = sorted(p.parent.name for p in (ROOT / "mcore_rl").glob("*/__init__.py"))
    assert "workers" in packages and "rl" in packages  # the glob sees the packages
    uncovered = [pkg for pkg in packages
                 if not any("pytest.mark.fast" in f.read_text()
                            for f in (ROOT / "tests" / pkg).glob("test_*.py"))]
    assert uncovered == [], f"no fast test for mcore_rl.{uncovered}"
