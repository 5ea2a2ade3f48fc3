"""`ClusterConfig`: the allocation an RL run is sized for (the run config's `cluster` section).

Preflight, the memory planner and the run's resolution (`mcore_rl.runconfig.resolve`) read it;
the launcher (e.g. scripts/slurm/train.sbatch) must request the same. A "local" cluster is
resolved to this machine by `mcore_rl.runconfig.resolve.resolved_cluster`, which returns a
ClusterConfig with device "gpu" or "cpu" describing what the run will use.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from mcore_rl.config import ConfigError, require_above, require_at_least


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The hardware a run is sized for.

    device: "local" (the default): this machine — CPU: one process per actor rank and engine
        TP worker, the machine's memory; GPU: the visible GPUs — leaving nodes,
        gpus_per_node, device_gib, reserve_gib and placement at their defaults.
        "gpu" / "cpu": the allocation the other fields describe.
    nodes, gpus_per_node: the allocation (on CPU: processes per node). device_gib: memory of
        one device. reserve_gib: per device, memory the estimate leaves for what it does not
        model (CUDA context, NCCL buffers, allocator fragmentation, transient workspaces).
    placement: "colocated" (every device holds one actor rank and one engine rank; the
        engines sleep during training, so rollout.enable_sleep) or "disaggregated" (engines on
        their own devices: actor world + rollout.tp · rollout.engines devices).
    """

    MOVED: ClassVar[dict[str, str]] = {"sync_backend": "set sync.backend"}

    device: Literal["local", "gpu", "cpu"] = "local"
    nodes: int = 1
    gpus_per_node: int = 8
    device_gib: float = 80.0
    reserve_gib: float = 3.0
    placement: Literal["colocated", "disaggregated"] = "disaggregated"

    def __post_init__(self) -> None:
        require_at_least(self, 1, "nodes", "gpus_per_node")
        require_above(self, 0, "device_gib")
        require_at_least(self, 0, "reserve_gib")
        changed = [
            f.name
            for f in fields(self)
            if f.name != "device" and getattr(self, f.name) != f.default
        ]
        if self.device == "local" and changed:
            raise ConfigError(
                "device",
                self.device,
                "sizes for this machine and ignores "
                f"{', '.join(changed)}: set device gpu or cpu to use them",
            )

    @property
    def total_devices(self) -> int:
        return self.nodes * self.gpus_per_node


__all__ = ["ClusterConfig"]
