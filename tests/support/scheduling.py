"""How the test files share the parallel workers (pytest hooks, imported by tests/conftest.py).

scripts/test.sh runs the suite on parallel pytest-xdist workers with `--dist loadfile`, which
this module's scheduler refines: a file's tests — and so its module fixtures — stay on one
worker, and the `WHOLE_MACHINE` files (end-to-end `mcore-rl` CLI runs with actor ranks and
engines, started and signalled again and again, that load every core) count as one file: they
run one after another on one worker, never two at once, so each stays near what it costs
alone and within the per-file budget (tests/support/durations.py).

Workers take the files in collection order; the `WHOLE_MACHINE` files, then the other files
with `slow` tests, are moved ahead, so a long file never starts last and leaves one worker
running it alone while the other has finished. The order inside each file is the collection's.
"""

from __future__ import annotations

import pytest

from tests.support.durations import file_of

WHOLE_MACHINE = ("tests/run/test_demo_learns.py", "tests/run/test_tool_demo_learns.py",
                 "tests/run/test_survive.py")


def worker_group(nodeid: str) -> str:
    """The unit a worker takes whole: the test's file, or all the `WHOLE_MACHINE` files."""
    file = file_of(nodeid)
    return "whole machine" if file in WHOLE_MACHINE else file


def schedule(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` stably reordered: the `WHOLE_MACHINE` files, then the other files with `slow`
    tests, then the rest."""
    slow = {file_of(item.nodeid) for item in items if item.get_closest_marker("slow")}
    return sorted(items, key=lambda item: (file_of(item.nodeid) not in WHOLE_MACHINE,
                                           file_of(item.nodeid) not in slow))


def pytest_collection_modifyitems(session, config, items):
    items[:] = schedule(items)


def pytest_xdist_make_scheduler(config, log):
    """xdist's `loadfile` scheduling with `worker_group` as the unit (other modes: xdist's)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkerGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return WorkerGroups(config, log)
