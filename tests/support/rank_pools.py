"""Spawned gloo ranks reused for the whole test run: every `run_on_ranks` of the session runs
on `RankPool`s (`mcore_rl.launch.spawn.pooled_ranks`) instead of spawning its ranks anew — a
rank's start (the process, `import torch`, megatron-core's import) costs seconds of CPU, and
the suite makes about a hundred such calls. Each call still gets its own store and default
group, and the pool puts its processes back as fresh ones before the next call. A call that
tests process-level behaviour passes `fresh_processes=True` and says why.

`MCORE_RL_FRESH_RANKS=1` runs the session without pools (every call spawns its ranks), to
tell a pool problem from a test's own."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def reused_ranks():
    from mcore_rl.launch.spawn import pooled_ranks

    if os.environ.get("MCORE_RL_FRESH_RANKS") == "1":
        yield
        return
    with pooled_ranks():
        yield
