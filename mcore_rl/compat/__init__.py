"""Adapters that let upstream libraries run where they were not written to run (CPU).

All monkeypatching of upstream code lives here and nowhere else. See `megatron_cpu`,
`lazy_compile` (installed by `mcore_rl/__init__.py`, so before any megatron import), and
`megatron_state` (megatron-core's globals put back between the calls of a reused rank).
"""

from __future__ import annotations


def apply_cpu_compat(device: str = "cpu") -> list[str]:
    """Make megatron-core usable without CUDA, for ranks computing on `device` (the run
    plan's: `ParallelGroups.device`); a no-op for a CUDA device.

    Idempotent: call it at every entry point that builds or runs megatron modules. Returns the
    shims installed by this call (empty when already applied or on GPU). The device rewrite is
    per thread (torch function modes are thread-local): call it in the thread that runs
    megatron.
    """
    if str(device).startswith("cuda"):
        return []
    from mcore_rl.compat import megatron_cpu

    return megatron_cpu.apply()


__all__ = ["apply_cpu_compat"]
