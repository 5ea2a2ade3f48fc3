"""mcore-rl's `vllm.general_plugins` entry point (setup.cfg): it registers the shard-only
weight transfer (weight_transfer.py) with vLLM's `WeightTransferEngineFactory` under the name
`BACKEND`. vLLM runs general plugins in every process it starts (the engine core and each
worker), so every worker can build the backend that `weight_transfer_config` names — and, on
a CPU platform, runs FP8 layers (`compat/vllm_fp8_cpu.py`).

vLLM loads a general plugin only when its entry point is installed and, where the
`VLLM_PLUGINS` allow-list is set, when the list names it (vllm/plugins/__init__.py,
`load_plugins_by_group`: the value split on ",", each name compared exactly); otherwise the
engine dies at load with "Invalid weight transfer backend". `plugin_missing` says which of the
two stops it, in one line, before an engine starts (and in preflight).

This module imports nothing from vLLM at import time: the engine side imports it to name the
backend and to check that the entry point is installed before an engine starts.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import Mapping, NamedTuple

from mcore_rl.compat import vllm_fp8_cpu

BACKEND = "mcore_rl"
PLUGIN_GROUP = "vllm.general_plugins"
ENGINE_CLASS = ("mcore_rl.rollout.weight_transfer", "ShardTransferEngine")
ALLOW_LIST = "VLLM_PLUGINS"  # vLLM's allow-list of plugin names (vllm/envs.py)


def register() -> None:
    """Register the backend with vLLM, lazily (the engine module is imported by the worker that
    builds it); on a CPU platform, give vLLM's FP8 casts their torch implementation
    (`compat/vllm_fp8_cpu.py`). Idempotent: vLLM may run general plugins more than once in a
    process."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory  # lazy: vllm
    from vllm.platforms import current_platform  # lazy: vllm

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, *ENGINE_CLASS)
    except ValueError:  # registered already in this process
        pass
    if current_platform.is_cpu():
        vllm_fp8_cpu.apply()


def entry_point_installed() -> bool:
    """Whether the installed mcore-rl package declares this entry point (what vLLM's worker
    processes find the backend through); False for a source tree used without installing."""
    return any(ep.name == BACKEND and ep.value == f"{__name__}:register"
               for ep in entry_points(group=PLUGIN_GROUP))


class PluginMissing(NamedTuple):
    """Why vLLM would not load the backend (`problem`) and what fixes it (`fix`)."""

    problem: str
    fix: str

    def __str__(self) -> str:  # the engine's one line
        return f"{self.problem} ({self.fix})"


def plugin_missing(env: Mapping[str, str] = os.environ) -> PluginMissing | None:
    """Why vLLM's processes started with `env` would not load the backend; None when they
    will. vLLM reads the allow-list as `VLLM_PLUGINS.split(",")` (set but empty allows
    nothing; a name with spaces around it is another name)."""
    if not entry_point_installed():
        return PluginMissing(
            f"vLLM's workers cannot find mcore-rl's weight-transfer backend: the {BACKEND!r} "
            f"entry point of {PLUGIN_GROUP} is not installed",
            "run scripts/setup.sh, or pip install -e . in the checkout")
    allowed = env.get(ALLOW_LIST)
    if allowed is not None and BACKEND not in allowed.split(","):
        return PluginMissing(
            f"{ALLOW_LIST}={allowed!r} leaves out {BACKEND!r}: vLLM loads only the plugins it "
            "lists, so its workers would not have mcore-rl's weight-transfer backend",
            f"{ALLOW_LIST}={','.join(filter(None, [allowed, BACKEND]))}, or unset it")
    return None


def plugin_installed(env: Mapping[str, str] = os.environ) -> bool:
    """Whether vLLM's processes started with `env` load the backend (`plugin_missing`)."""
    return plugin_missing(env) is None


__all__ = ["ALLOW_LIST", "BACKEND", "PluginMissing", "entry_point_installed",
           "plugin_installed", "plugin_missing", "register"]
