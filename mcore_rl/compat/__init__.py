"""Adapters that let upstream libraries run where they were not written to run (CPU).

All monkeypatching of upstream code lives here and nowhere else. See `megatron_cpu`,
`lazy_compile` (installed by `mcore_rl/__init__.py`, so before any megatron import), and
`megatron_state` (megatron-core's globals put back between the calls of a reused rank).
"""

from __future__ import annotations


def apply_cpu_compat(device: str = "cpu") -> list[str]:
    """Make megatron-core usable without CUDA, for ranks computing on `device` (the run
    plan's: `ParallelGroups.device`). On a CUDA device only the shims of megatron-core's gaps
    without TransformerEngine (`megatron_cpu.WITHOUT_TE`), which are not about the device.

    Idempotent: call it at every entry point that builds or runs megatron modules. Returns the
    shims installed by this call (empty when already applied). The device rewrite is
    per thread (torch function modes are thread-local): call it in the thread that runs
    megatron.
    """
    from mcore_rl.compat import megatron_cpu  # lazy: torch

    if str(device).startswith("cuda"):
        # megatron-core's own gap without TransformerEngine, whatever the device
        return megatron_cpu.apply(only=list(megatron_cpu.WITHOUT_TE))
    return megatron_cpu.apply()


__all__ = ["apply_cpu_compat"]
