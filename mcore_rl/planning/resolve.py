"""The resolved run: what an RL run *will* do on this hardware, decided once.

A config (`RLConfig`) is what the user asked for; a `ResolvedRun` is what will happen: the
compute device of every rank, the Megatron layer spec (and so the parameter names), the
weight-sync backend, the transport of every engine, and the dtypes. `resolve_run` is pure —
it reads the config and a description of the device (detected, or assumed with
`assume_gpu`) and nothing else — so `mcore-rl explain` prints exactly what the controller
then hands to every worker. Workers never re-derive any of these choices from
`torch.cuda.is_available()`.

Rules (shared/FINDINGS.md, ../shared/STYLE.md "Resolve once, then obey"):
- device: "cuda" when the cluster section says gpu, or says local and CUDA is there (or
  `assume_gpu`); else "cpu".
- layer_spec: "te" (TransformerEngine) on cuda, "local" (megatron's pure-PyTorch spec) on cpu.
- sync_backend: `cluster.sync_backend` as configured on a gpu cluster; on a local cluster the
  device's own (nccl on cuda, gloo on cpu).
- transports: per engine, "ipc" when any of its TP ranks shares a device with a trainer rank
  (colocated: NCCL refuses two ranks of one group on one device, so the bytes go through a
  shared staging buffer — CUDA IPC on GPU, shared memory on CPU), else "p2p" over the sync
  group.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from mcore_rl.launch.placement import PlacementPlan, plan_placement

if TYPE_CHECKING:  # the run config imports the planner; the planner only reads it
    from mcore_rl.trainer.rl_config import RLConfig

Device = Literal["cpu", "cuda"]
Transport = Literal["p2p", "ipc"]


@dataclass(frozen=True)
class ResolvedRun:
    """What will run. Picklable: the controller sends it to every worker.

    device: what every actor rank and engine computes on.
    layer_spec: megatron's "te" or "local" layer spec — decides the parameter names.
    sync_backend: the process-group backend of the weight-sync group.
    transports[e]: how engine e receives weights ("p2p" or "ipc").
    actor_devices[r]: torch device of actor rank r ("cpu", or "cuda:<local index>").
    engine_devices[e][t]: the same for engine e's TP rank t.
    param_dtype: the actor's parameters ("fp32"/"bf16"); rollout_dtype: the engines' model
    dtype ("float32"/"bfloat16"/"float16"); wire_dtype: the weight sync's ("fp32"/"bf16").
    placement: the device plan the devices above come from.
    """

    device: Device
    layer_spec: Literal["local", "te"]
    sync_backend: Literal["gloo", "nccl"]
    transports: tuple[Transport, ...]
    actor_devices: tuple[str, ...]
    engine_devices: tuple[tuple[str, ...], ...]
    param_dtype: str
    rollout_dtype: str
    wire_dtype: str
    placement: PlacementPlan

    def summary(self) -> dict:
        """The JSON-able view `mcore-rl explain` prints as its last line."""
        out = asdict(self)
        out["placement"] = self.placement.placement
        out["transports"] = list(self.transports)
        out["actor_devices"] = list(self.actor_devices)
        out["engine_devices"] = [list(e) for e in self.engine_devices]
        return out


def cuda_present() -> bool:
    """Whether this process sees a CUDA device (the one place resolution asks torch)."""
    import torch

    return torch.cuda.is_available()


def run_device(cfg: "RLConfig", *, assume_gpu: bool = False,
               cuda_available: bool | None = None) -> Device:
    """The compute device of the run (see the module docstring)."""
    if cfg.cluster.device == "gpu":
        return "cuda"
    if cfg.cluster.device == "cpu":
        return "cpu"
    if assume_gpu:
        return "cuda"
    present = cuda_present() if cuda_available is None else cuda_available
    return "cuda" if present else "cpu"


def placement_plan_of(cfg: "RLConfig") -> PlacementPlan:
    """The run's devices: as `cluster` describes them; for a "local" cluster, one node
    holding the actor's ranks, then the engines' (disaggregated)."""
    world, tp = cfg.actor.world_size, cfg.rollout.tp
    if cfg.cluster.device != "local":
        placement, per_node = cfg.cluster.placement, cfg.cluster.gpus_per_node
    else:
        placement = "disaggregated"
        per_node = -(-world // tp) * tp + tp * cfg.rollout.engines
    return plan_placement(actor_world=world, engine_tp=tp, engines=cfg.rollout.engines,
                          devices_per_node=per_node, placement=placement)


def resolve_run(cfg: "RLConfig", *, assume_gpu: bool = False,
                cuda_available: bool | None = None) -> ResolvedRun:
    """The one resolution of `cfg` on this machine (or on an assumed GPU machine)."""
    device = run_device(cfg, assume_gpu=assume_gpu, cuda_available=cuda_available)
    plan = placement_plan_of(cfg)
    if cfg.cluster.device == "gpu":
        backend = cfg.cluster.sync_backend
    else:
        backend = "nccl" if device == "cuda" else "gloo"
    actor_slots = set(plan.actor)
    transports = tuple("ipc" if any(s in actor_slots for s in slots) else "p2p"
                       for slots in plan.engines)

    def where(slot) -> str:
        return f"cuda:{slot.device}" if device == "cuda" else "cpu"

    return ResolvedRun(
        device=device,
        layer_spec="te" if device == "cuda" else "local",
        sync_backend=backend,
        transports=transports,
        actor_devices=tuple(where(s) for s in plan.actor),
        engine_devices=tuple(tuple(where(s) for s in slots) for slots in plan.engines),
        param_dtype=cfg.train.dtype,
        rollout_dtype=cfg.rollout.dtype,
        wire_dtype=cfg.wire_dtype,
        placement=plan,
    )


__all__ = ["ResolvedRun", "cuda_present", "placement_plan_of", "resolve_run", "run_device"]
