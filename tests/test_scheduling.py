"""The parallel workers' units (tests/support/scheduling.py): the whole-machine files are one
unit and exist; every other file is its own; long files go first, each file whole."""

from pathlib import Path

import pytest

from tests.support.scheduling import WHOLE_MACHINE, worker_group

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

ROOT = Path(__file__).resolve().parents[1]


def test_the_whole_machine_files_exist_and_share_one_worker():
    assert len(WHOLE_MACHINE) > 1 and all((ROOT / f).is_file() for f in WHOLE_MACHINE)
    groups = {worker_group(f"{f}::test_x[1]") for f in WHOLE_MACHINE}
    assert len(groups) == 1 and groups != {WHOLE_MACHINE[0]}


def test_every_other_file_is_its_own_unit():
    assert worker_group("tests/rl/test_controller.py::test_a") == "tests/rl/test_controller.py"
    assert worker_group("tests/rl/test_controller.py::test_b[x::y]") == \
        "tests/rl/test_controller.py"


def test_files_with_slow_tests_start_first_each_file_kept_whole_and_in_order():
    from dataclasses import dataclass

    from tests.support.scheduling import schedule

    @dataclass
    class Item:  # what schedule reads of a pytest item
        nodeid: str
        slow: bool = False

        def get_closest_marker(self, name):
            return name == "slow" and self.slow or None

    items = [Item("tests/a/test_quick.py::t1"), Item("tests/a/test_long.py::t1"),
             Item("tests/a/test_long.py::t2", slow=True), Item(f"{WHOLE_MACHINE[1]}::t1"),
             Item("tests/b/test_quick.py::t1"), Item(f"{WHOLE_MACHINE[0]}::t1")]
    assert [i.nodeid for i in schedule(items)] == [
        f"{WHOLE_MACHINE[1]}::t1", f"{WHOLE_MACHINE[0]}::t1", "tests/a/test_long.py::t1",
        "tests/a/test_long.py::t2", "tests/a/test_quick.py::t1", "tests/b/test_quick.py::t1"]
