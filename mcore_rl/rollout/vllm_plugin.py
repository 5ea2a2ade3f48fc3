"""mcore-rl's `vllm.general_plugins` entry point (setup.cfg): it registers the shard-only
weight transfer (weight_transfer.py) with vLLM's `WeightTransferEngineFactory` under the name
`BACKEND`. vLLM runs general plugins in every process it starts (the engine core and each
worker), so every worker can build the backend that `weight_transfer_config` names.

This module imports nothing from vLLM at import time: the engine side imports it to name the
backend and to check that the entry point is installed before an engine starts.
"""

from __future__ import annotations

from importlib.metadata import entry_points

BACKEND = "mcore_rl"
PLUGIN_GROUP = "vllm.general_plugins"
ENGINE_CLASS = ("mcore_rl.rollout.weight_transfer", "ShardTransferEngine")


def register() -> None:
    """Register the backend with vLLM, lazily (the engine module is imported by the worker that
    builds it). Idempotent: vLLM may run general plugins more than once in a process."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, *ENGINE_CLASS)
    except ValueError:  # registered already in this process
        pass


def plugin_installed() -> bool:
    """Whether the installed mcore-rl package declares this entry point (what vLLM's worker
    processes find the backend through); False for a source tree used without installing."""
    return any(ep.name == BACKEND and ep.value == f"{__name__}:register"
               for ep in entry_points(group=PLUGIN_GROUP))


__all__ = ["BACKEND", "plugin_installed", "register"]
