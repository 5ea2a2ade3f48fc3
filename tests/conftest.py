"""Shared test fixtures. Distributed tests spawn gloo ranks through `mcore_rl.launch.spawn`."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray (imported by vLLM too) binds to localhost only when this is set before its first import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
