"""Where every worker of an RL run lives: which node and which device of that node.

Two placements (verl / NeMo-RL call them colocated / disaggregated):
- disaggregated: the actor's ranks hold devices 0 .. W-1 of the allocation (numbered node-major),
  the engines' TP ranks the next E·tp devices. Training and generation never share memory.
- colocated: every device holds one actor rank and one engine TP rank (actor rank d and
  engine rank d share device d); the engines sleep while the actor trains (vLLM sleep mode
  frees their weights and KV cache on GPU).
An engine's TP ranks must sit on one node: its mp executor spawns them as local processes.

`plan_placement` is pure (unit-tested); `RayPlacement` realizes a plan with one Ray placement
group bundle per node, so each Ray actor lands on its node. Devices are not Ray resources
here: a training rank selects its device by local index (`torch.cuda.set_device`), an engine
narrows CUDA_VISIBLE_DEVICES to its TP devices before vLLM starts (`restrict_visible_devices`)
— Ray's own GPU accounting cannot express a device shared by two actors of which one needs
several whole devices (an engine with tp > 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from mcore_rl.config import ConfigError

Placement = Literal["colocated", "disaggregated"]


@dataclass(frozen=True)
class Slot:
    """One device: the node it is on and its local index there."""

    node: int
    device: int


@dataclass(frozen=True)
class PlacementPlan:
    """actor[r]: the device of actor rank r. engines[e][t]: the device of engine e's TP rank t."""

    placement: Placement
    devices_per_node: int
    actor: tuple[Slot, ...]
    engines: tuple[tuple[Slot, ...], ...]

    @property
    def nodes(self) -> int:
        used = [s.node for s in self.actor] + [s.node for e in self.engines for s in e]
        return max(used) + 1

    def engine_node(self, engine: int) -> int:
        return self.engines[engine][0].node

    def shared_devices(self) -> int:
        """Devices that hold both an actor rank and an engine rank."""
        return len(set(self.actor) & {s for e in self.engines for s in e})


def _slot(index: int, devices_per_node: int) -> Slot:
    return Slot(index // devices_per_node, index % devices_per_node)


def plan_placement(*, actor_world: int, engine_tp: int, engines: int, devices_per_node: int,
                   placement: Placement) -> PlacementPlan:
    """Devices for every actor rank and engine TP rank (see the module docstring).
    Raises ConfigError naming the field that does not fit."""
    if devices_per_node < 1:
        raise ConfigError("cluster.gpus_per_node", devices_per_node, "must be >= 1")
    if devices_per_node % engine_tp:
        raise ConfigError("rollout.tp", engine_tp, f"an engine's TP ranks must share a node: "
                                                    f"must divide {devices_per_node} devices per node")
    first_engine_device = 0
    if placement == "colocated":
        if engine_tp * engines != actor_world:
            raise ConfigError("rollout.engines", engines,
                              f"colocated placement puts one engine rank on each of the "
                              f"actor's {actor_world} devices: need rollout.tp · "
                              f"rollout.engines = {actor_world}")
    elif placement == "disaggregated":
        # engines start on a fresh node boundary when the actor's last node is partly used
        # and the engine would straddle it
        first_engine_device = actor_world
        if first_engine_device % engine_tp:
            first_engine_device += engine_tp - first_engine_device % engine_tp
    else:
        raise ConfigError("cluster.placement", placement, "must be colocated or disaggregated")
    actor = tuple(_slot(r, devices_per_node) for r in range(actor_world))
    engine_slots = tuple(
        tuple(_slot(first_engine_device + e * engine_tp + t, devices_per_node)
              for t in range(engine_tp))
        for e in range(engines))
    return PlacementPlan(placement, devices_per_node, actor, engine_slots)


# Ray leaves CUDA_VISIBLE_DEVICES alone in an actor started with this set (vLLM's Ray executor
# sets it for the same reason): we narrow it ourselves, from the placement plan.
RAY_NOSET_VISIBLE_DEVICES = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def restrict_visible_devices(local_devices: list[int]) -> str:
    """Narrow CUDA_VISIBLE_DEVICES to these local devices (indices into what the node
    exposes: the physical slots of the placement plan); returns the new value. Call it only
    on a run resolved to cuda, before anything in this process touches CUDA: it reads the
    environment alone — asking torch how many devices there are would initialize CUDA, which
    then never sees the narrowed set (every engine after the node's first would address
    devices that are not its own). Unset means the node exposes its devices 0..n-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([v.strip() for v in visible.split(",") if v.strip()] if visible is not None
           else [str(d) for d in range(max(local_devices, default=-1) + 1)])
    if any(d < 0 or d >= len(ids) for d in local_devices):
        raise RuntimeError(f"local devices {local_devices} not all among this node's visible "
                           f"devices {ids}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[d] for d in local_devices)
    return os.environ["CUDA_VISIBLE_DEVICES"]


def node_bundles(plan: PlacementPlan, *, cpus_per_engine: float,
                 gpu: bool) -> list[dict[str, float]]:
    """What each node of the plan reserves in Ray (its placement-group bundle, node order):
    the CPUs its engines ask for (`cpus_per_engine` each), at least 1, and on GPU every device
    of the node. What the allocation must offer per node (`launch.allocation`)."""
    bundles = []
    for node in range(plan.nodes):
        engines_here = sum(plan.engine_node(e) == node for e in range(len(plan.engines)))
        bundle = {"CPU": max(1.0, engines_here * cpus_per_engine)}
        if gpu:
            bundle["GPU"] = float(plan.devices_per_node)
        bundles.append(bundle)
    return bundles


class RayPlacement:
    """One placement-group bundle per node of the plan (STRICT_SPREAD over nodes, so bundle n
    is a node of its own); `options_for_node(n)` schedules a Ray actor into bundle n.

    Each bundle reserves the CPUs its engines ask for (`cpus_per_engine`), at least 1, plus
    the node's GPUs on GPU (so no other job's actors take them)."""

    def __init__(self, plan: PlacementPlan, *, cpus_per_engine: float, gpu: bool,
                 timeout_s: float = 120.0):
        import ray  # lazy: ray
        from ray.util.placement_group import placement_group  # lazy: ray

        self.plan = plan
        self.gpu = gpu  # engines narrow CUDA_VISIBLE_DEVICES to their slots only on GPU
        bundles = node_bundles(plan, cpus_per_engine=cpus_per_engine, gpu=gpu)
        strategy = "STRICT_SPREAD" if len(bundles) > 1 else "PACK"
        self.group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.group)
            raise RuntimeError(f"Ray could not place {len(bundles)} node bundles {bundles} "
                               f"({strategy}) within {timeout_s:.0f} s: the cluster has "
                               f"{ray.cluster_resources()}")

    def options_for_node(self, node: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # lazy: ray

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=node)}

    def remove(self) -> None:
        import ray  # lazy: ray

        ray.util.remove_placement_group(self.group)
