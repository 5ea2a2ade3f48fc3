"""The ranks a conversion runs on: one process, torchrun/srun workers, or `--workers N` local
processes (mcore_rl.launch.spawn). Each rank converts a disjoint share of the tensors; the
helpers here are the few collectives the converters need, on the default (gloo) group."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from mcore_rl.parallel.world import join_default_group

T = TypeVar("T")


class RankFailed(RuntimeError):
    """Another rank failed; its own error is reported by that rank."""


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.is_first else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(t)
        return t.tolist()

    def agree(self, fn: Callable[[], T]) -> T:
        """Run `fn` here, then make every rank fail if any rank's `fn` raised (so no rank is
        left waiting in a collective for a peer that already gave up)."""
        error: BaseException | None = None
        result = None
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 — re-raised below, on every rank
            error = err
        failed = self.sum([1.0 if error is not None else 0.0])[0]
        if error is not None:
            raise error
        if failed:
            raise RankFailed(f"rank {self.rank}: {int(failed)} other rank(s) failed (see their "
                             "errors)")
        return result


def current_ranks() -> Ranks:
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    return Ranks()


def init_from_env(timeout_s: float = 7200.0) -> Ranks:
    """Join the job's ranks when launched by torchrun (RANK/WORLD_SIZE) or srun
    (SLURM_PROCID/SLURM_NTASKS; MASTER_ADDR defaults to the launch node, MASTER_PORT to one
    derived from the job id). One process otherwise."""
    if dist.is_available() and dist.is_initialized():
        return current_ranks()
    env = os.environ
    if "RANK" not in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env.setdefault("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    join_default_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return current_ranks()


def leave(*, wait_for_all: bool) -> None:
    """Leave the job's process group before the interpreter exits. Left to interpreter
    teardown, gloo's worker threads can be destroyed while still joinable, and the process
    aborts ("terminate called without an active exception") after a conversion that
    succeeded. (Leaving frees the group only if nothing pins it: mcore_rl/parallel/world.py.)
    `wait_for_all`: meet the other ranks first (only when every rank got this far; after an
    error a rank may be gone, and a barrier would wait out the whole timeout)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait_for_all:
        dist.barrier()
    dist.destroy_process_group()


def partition(sizes: Sequence[int], world: int) -> list[int]:
    """Owner rank of each item: largest first onto the least-loaded rank (deterministic)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner
