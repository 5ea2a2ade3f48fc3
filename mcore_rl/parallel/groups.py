"""Explicit process groups of the training grid, built once from megatron-core at start-up.

megatron-core keeps its groups in module globals; this is the one place that reads them.
Everything else takes a `ParallelGroups` argument, so a job that also holds inference and
sync groups can never pick up the wrong grid's group by accident.
"""

from __future__ import annotations

import datetime
import enum
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.host_allocator import pays_off, reuse_freed_host_memory
from mcore_rl.parallel.world import join_default_group


class Axis(str, enum.Enum):
    """A parallel dimension of a grid ("dim" is reserved for tensor dimensions)."""

    TP = "tp"
    PP = "pp"
    DP = "dp"
    EP = "ep"  # expert parallel: splits a layer's experts
    ETP = "etp"  # expert tensor parallel: splits each expert's MLP
    EDP = "edp"  # expert data parallel: replicas of an expert (tp·dp / (etp·ep) per stage)


def backend_for(device: str) -> str:
    """The training world's backend for ranks computing on `device`: NCCL for CUDA, gloo
    for the host — chosen here and nowhere else."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def default_backend() -> str:
    """The backend of a program that has no resolved run (train-lm, ranks spawned by
    torchrun or the test helper): NCCL where CUDA is, gloo elsewhere. An RL run's workers
    are handed their device by the run plan instead (`join_worker_world`)."""
    return backend_for("cuda" if torch.cuda.is_available() else "cpu")


def _device_of_world() -> str:
    """The device of this rank in a world joined without a resolved run: the current CUDA
    device under NCCL, else the host."""
    if dist.get_backend() == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


@dataclass(frozen=True)
class ParallelGroups:
    """The training grid: its config, this rank's coordinates and the group of each axis.

    `megatron` is megatron-core's `ProcessGroupCollection` for the same groups, for the
    megatron modules that take a `pg_collection` argument. `expert_coords`: this rank's place
    on the expert grid ({"etp", "ep", "edp", "pp"}, see ParallelConfig.expert_coords_of).
    `device`: the torch device this rank computes on ("cpu" or "cuda:<i>"): what models are
    built on, read by everything that would otherwise ask torch whether CUDA exists.
    """

    config: ParallelConfig
    rank: int
    coords: dict
    groups: dict
    megatron: object
    expert_coords: dict = field(default_factory=lambda: {"etp": 0, "ep": 0, "edp": 0})
    device: str = "cpu"

    def group(self, axis: Axis) -> dist.ProcessGroup:
        return self.groups[Axis(axis)]

    def rank_in(self, axis: Axis) -> int:
        axis = Axis(axis)
        return (
            self.coords[axis.value] if axis.value in self.coords else self.expert_coords[axis.value]
        )

    def size_of(self, axis: Axis) -> int:
        return {Axis.ETP: self.config.expert_tp, Axis.EDP: self.config.expert_dp}.get(
            Axis(axis)
        ) or getattr(self.config, Axis(axis).value)

    @property
    def is_first_stage(self) -> bool:
        return self.rank_in(Axis.PP) == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank_in(Axis.PP) == self.config.pp - 1


def init_training_groups(
    config: ParallelConfig, *, timeout_s: float = 600.0, device: str | None = None
) -> ParallelGroups:
    """Create megatron-core's model-parallel state for `config` and return it as groups.

    The default process group must exist (torchrun / the test helper / the Ray worker sets it
    up) and its world size must equal tp * pp * dp. device: this rank's torch device as the
    run plan resolved it (None: the world's, see `_device_of_world`).
    """
    from megatron.core import parallel_state as mpu  # lazy: megatron
    from megatron.core.process_groups_config import ProcessGroupCollection  # lazy: megatron

    if not dist.is_initialized():
        join_default_group(default_backend(), timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != config.world_size:
        raise ValueError(
            f"parallel: tp*pp*dp = {config.tp}*{config.pp}*{config.dp} = "
            f"{config.world_size} but the job has {world} ranks"
        )
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=config.vpp,
        expert_model_parallel_size=config.ep,
        expert_tensor_parallel_size=config.expert_tp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    rank = dist.get_rank()
    coords, expert_coords = _checked_coords(config, rank)
    groups = {
        Axis.TP: mpu.get_tensor_model_parallel_group(),
        Axis.PP: mpu.get_pipeline_model_parallel_group(),
        Axis.DP: mpu.get_data_parallel_group(),
        Axis.EP: mpu.get_expert_model_parallel_group(),
        Axis.ETP: mpu.get_expert_tensor_parallel_group(),
        Axis.EDP: mpu.get_expert_data_parallel_group(),
    }
    return ParallelGroups(
        config=config,
        rank=rank,
        coords=coords,
        groups=groups,
        megatron=ProcessGroupCollection.use_mpu_process_groups(),
        expert_coords=expert_coords,
        device=device or _device_of_world(),
    )


def _checked_coords(config: ParallelConfig, rank: int) -> tuple[dict, dict]:
    """This rank's coordinates on the grid and on the expert grid as megatron-core placed it,
    checked against mcore-rl's grid order (`ParallelConfig.coords_of`, `expert_coords_of`)."""
    from megatron.core import parallel_state as mpu  # lazy: megatron

    coords = {
        "tp": mpu.get_tensor_model_parallel_rank(),
        "pp": mpu.get_pipeline_model_parallel_rank(),
        "dp": mpu.get_data_parallel_rank(),
    }
    if coords != config.coords_of(rank):
        raise RuntimeError(
            f"megatron-core placed rank {rank} at {coords}, but mcore-rl's grid "
            f"order expects {config.coords_of(rank)}"
        )
    expert_coords = {
        "etp": mpu.get_expert_tensor_parallel_rank(),
        "ep": mpu.get_expert_model_parallel_rank(),
        "edp": mpu.get_expert_data_parallel_rank(),
        "pp": coords["pp"],
    }
    if expert_coords != config.expert_coords_of(rank):
        raise RuntimeError(
            f"megatron-core placed rank {rank} at {expert_coords} on the expert "
            f"grid, but mcore-rl expects {config.expert_coords_of(rank)}"
        )
    return coords, expert_coords


def destroy_training_groups() -> None:
    from megatron.core import parallel_state as mpu  # lazy: megatron

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()


def join_worker_world(
    rank: int,
    world_size: int,
    store_address: tuple[str, int],
    parallel: ParallelConfig,
    *,
    timeout_s: float,
    device: str,
    largest_step_bytes: float = 0.0,
) -> ParallelGroups:
    """A role's Ray worker joins its role's world: one intra-op thread (the workers share the
    machine's cores), `device` (the run plan's torch device of this rank: "cpu" or
    "cuda:<i>") made current before anything is allocated, the process group on that device's
    backend through the TCPStore the driver hosts at `store_address` (world_size + 1 members:
    the driver holds one), then megatron's groups for `parallel`. A CPU rank whose per-step
    tensors reach `largest_step_bytes` keeps its freed large buffers for reuse where that pays
    (`host_allocator`)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    elif pays_off(largest_step_bytes):  # the caching a CUDA device's allocator gives
        reuse_freed_host_memory()
    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = store_address
    store = dist.TCPStore(host, port, world_size + 1, is_master=False, timeout=timeout)
    join_default_group(
        backend_for(device), store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    return init_training_groups(parallel, timeout_s=timeout_s, device=device)


def leave_worker_world() -> None:
    """Undo `join_worker_world` (megatron's groups, then the process group)."""
    destroy_training_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
