"""Shared test fixtures. Distributed tests spawn gloo ranks through `mcore_rl.launch.spawn`."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray (imported by vLLM too) binds to localhost only when this is set before its first import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# One vLLM cache (model inspection, compile artefacts) for every engine of the run, in a fresh
# directory: each engine started in this run reuses what the first one wrote.
if "VLLM_CACHE_ROOT" not in os.environ:
    import tempfile

    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="mcore_rl_tests_vllm_cache_")

# the slowest test files, and CI's budget per file (tests/support/durations.py)
from tests.support.durations import (pytest_runtest_logreport, pytest_sessionfinish,  # noqa: E402,F401
                                     pytest_terminal_summary)
# which tests share a parallel worker, and in what order (tests/support/scheduling.py)
from tests.support.scheduling import (pytest_collection_modifyitems,  # noqa: E402,F401
                                      pytest_xdist_make_scheduler)
# one local Ray for the session's RL tests, each checked to leave nothing in it
# (tests/support/ray_cluster.py)
from tests.support.ray_cluster import (pytest_runtest_teardown, ray_cluster,  # noqa: E402,F401
                                       ray_session)
# spawned gloo ranks reused from call to call for the whole run (tests/support/rank_pools.py)
from tests.support.rank_pools import reused_ranks  # noqa: E402,F401
