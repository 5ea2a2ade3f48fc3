"""A CPU rank reuses its freed large buffers (mcore_rl/parallel/host_allocator.py): a tensor the
size of a step's logits, freed and allocated again, comes back from malloc's heap with its
pages already mapped, where glibc's default maps it afresh and page-faults it in again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast

# in a fresh interpreter: mallopt changes the whole process's allocator
ALLOCATE_TWICE = """
import json, resource, sys, torch
from mcore_rl.parallel.host_allocator import reuse_freed_host_memory
applied = reuse_freed_host_memory() if sys.argv[1] == "reuse" else None
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logits = torch.empty(1024, 16384)  # 64 MiB: above any mmap threshold glibc allows
    logits.fill_(1.0)
    del logits
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_step()  # the first step maps the memory either way
print(json.dumps({"applied": applied, "faults": faults_of_one_step()}))
"""

PAGES_OF_64_MIB = 64 * 2**20 // 4096


def _second_step(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ALLOCATE_TWICE, mode], capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_freed_large_buffer_is_reused_without_page_faults():
    reused = _second_step("reuse")
    assert reused["applied"] is True  # glibc (this machine's and CI's C library)
    assert reused["faults"] < PAGES_OF_64_MIB // 100, reused
    # the default it replaces: every step faults the whole buffer in again
    assert _second_step("default")["faults"] > PAGES_OF_64_MIB // 2
