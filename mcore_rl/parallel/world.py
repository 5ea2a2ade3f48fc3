"""Joining the default process group: every entry point (training workers, converters, the
spawn and SLURM launchers) does it through `join_default_group`, so that leaving it with
`dist.destroy_process_group()` really ends it.

Why a wrapper: `torch.distributed.nn.functional` declares its collectives with
`group=group.WORLD` default arguments, evaluated when the module is first imported. Imported
after the group exists (megatron-core, torch.distributed.checkpoint and torch._dynamo all pull
it in), those defaults hold the live group, and `destroy_process_group()` can no longer free
it: its gloo threads (`gloo_tcp_loop`, `pt_gloo_runloop`) outlive the group into interpreter
teardown, where a rank can abort after its work succeeded ("terminate called without an
active exception", seen in CI on a 2-rank srun conversion). Imported before, the defaults are
None, which means the default group at call time.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

# Modules that capture the default group at import time (see above).
_CAPTURE_GROUP_AT_IMPORT = ("torch.distributed.nn",)


def join_default_group(backend: str, **kwargs) -> None:
    """`dist.init_process_group(backend, **kwargs)`, after importing the modules that would
    otherwise pin the group for the life of the process."""
    for module in _CAPTURE_GROUP_AT_IMPORT:
        importlib.import_module(module)
    dist.init_process_group(backend, **kwargs)
