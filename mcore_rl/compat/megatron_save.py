"""megatron-core 0.16.1's dist-checkpoint writer, without a spawned process on a rank's first
save (CPU and GPU alike).

`dist_checkpointing.save` hands each rank's write results back through a queue that
`strategies.filesystem_async._get_write_results_queue` makes, the first time a process saves,
as `multiprocessing.get_context("spawn").Manager().Queue()`: a server process, there for an
asynchronous save whose writer runs in another process. A spawned process re-imports its
parent's `__main__`: in an actor rank that is Ray's default_worker.py, so every rank paid an
import of all of Ray on its first checkpoint (1-3 s of wall per rank on a 2-core machine) and
kept the server process for the rest of its life.

mcore-rl saves synchronously (`megatron.role_checkpoint.save_role`): megatron's `execute_sync`
runs the writer in the saving thread, which puts the results in the queue and reads them back
(`get_nowait`) in that same thread, so a plain `queue.Queue` of the process carries them.
`install()` makes the factory return one. (An asynchronous save would need the Manager back:
only `save_role` installs this.) A forked Manager is no way out: it would hold copies of the
rank's sockets, so a rank that dies would not close its gloo connections and its peers would
wait out their timeout instead of failing at once. Written against megatron-core
`megatron_cpu.MEGATRON_CORE_VERSION`; tests/compat/test_megatron_save.py fails once upstream no
longer makes a Manager.
"""

from __future__ import annotations

import queue

# Marks the function installed here, so `install()` can tell it already ran.
_SHIM_ATTR = "_mcore_rl_save_shim"


def _in_process_results_queue() -> queue.Queue:
    """filesystem_async._get_write_results_queue for synchronous saves: one queue per
    process, made on first use and kept in the module's own cache."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # lazy: megatron

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    return filesystem_async._results_queue


setattr(_in_process_results_queue, _SHIM_ATTR, True)


def install() -> bool:
    """Replace megatron's results-queue factory (idempotent: False when already replaced).
    Call it before a synchronous save, in the process that saves."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # lazy: megatron

    from mcore_rl.compat.megatron_cpu import check_version  # lazy: torch

    check_version()
    if getattr(filesystem_async._get_write_results_queue, _SHIM_ATTR, False):
        return False
    filesystem_async._get_write_results_queue = _in_process_results_queue
    return True


__all__ = ["install"]
