"""The suite's time by test file, and a budget per file (pytest hooks, imported by
tests/conftest.py).

Every run ends with the slowest test files and the total. With `MCORE_RL_FILE_BUDGET_S` set
(CI sets it in .ci/run), a file whose tests took longer in all — setup, call and teardown,
module fixtures included — fails the run, naming it: a change that doubles a file's time is
seen the day it lands. A file's time is what its tests cost in this run; run it alone
(`pytest FILE --durations=0`) to see where.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

BUDGET_ENV = "MCORE_RL_FILE_BUDGET_S"
SHOWN_FILES = 10

_seconds: Counter[str] = Counter()


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def budget_s() -> float | None:
    value = os.environ.get(BUDGET_ENV)
    return float(value) if value else None


def over_budget(seconds: dict[str, float], budget: float | None) -> list[tuple[str, float]]:
    """The files over `budget` seconds, slowest first (none without a budget)."""
    if budget is None:
        return []
    return sorted(((f, s) for f, s in seconds.items() if s > budget), key=lambda fs: -fs[1])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[file_of(report.nodeid)] += report.duration


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if over_budget(_seconds, budget_s()) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config) -> None:
    if not _seconds:
        return
    budget = budget_s()
    write = terminalreporter.write_line
    terminalreporter.section("time by test file")
    for name, seconds in _seconds.most_common(SHOWN_FILES):
        write(f"{seconds:8.1f} s  {name}")
    write(f"{sum(_seconds.values()):8.1f} s  in all, {len(_seconds)} files"
          + (f" (budget {budget:.0f} s per file, {BUDGET_ENV})" if budget else ""))
    for name, seconds in over_budget(_seconds, budget):
        write(f"OVER BUDGET: {name} took {seconds:.1f} s, more than {budget:.0f} s: make it "
              "faster (share its start-ups, merge what it proves twice)", red=True)
