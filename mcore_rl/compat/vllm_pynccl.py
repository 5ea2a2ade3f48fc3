"""vLLM's PyNccl in a process that is not a vLLM engine (a trainer rank, the driver).

The GPU sync group talks NCCL through vLLM's `PyNcclCommunicator` on both sides
(`resharding/nccl_group.py`). Importing any part of vLLM runs `vllm.env_override` first,
which writes process-wide environment variables meant for vLLM's own processes
(`PYTORCH_NVML_BASED_CUDA_CHECK`, `TORCHINDUCTOR_COMPILE_THREADS`,
`TRITON_CACHE_AUTOTUNING`, `LD_LIBRARY_PATH` for CUDA's compatibility libraries, ...). In a
Megatron rank they would change how torch probes CUDA, how `torch.compile` compiles and
what every subprocess loads. `pynccl()` imports PyNccl once with the environment put back
exactly as it was, and reports which variables vLLM had changed. The inductor patches
vLLM applies at import stay: they are workarounds of inductor bugs guarded by torch
version, and they touch nothing unless the rank compiles (`train.compile`).
"""

from __future__ import annotations

import os
from types import ModuleType

# the variables vLLM's import changed in this process, put back (empty: none, or vLLM was
# already imported when `pynccl` was first called)
RESTORED: list[str] = []


def pynccl() -> tuple[ModuleType, ModuleType]:
    """vLLM's `pynccl` and `pynccl_wrapper` modules, imported with the process environment
    left as it was (see the module docstring)."""
    before = dict(os.environ)
    from vllm.distributed.device_communicators import pynccl as communicator  # lazy: vllm
    from vllm.distributed.device_communicators import pynccl_wrapper as wrapper  # lazy: vllm

    changed = sorted(k for k in set(before) | set(os.environ)
                     if before.get(k) != os.environ.get(k))
    for key in changed:
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    RESTORED.extend(k for k in changed if k not in RESTORED)
    return communicator, wrapper


__all__ = ["RESTORED", "pynccl"]
