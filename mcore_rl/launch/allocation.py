"""A SLURM allocation against what a run's Ray placement group will ask of it.

`RayPlacement` reserves one bundle per node of the plan (`placement.node_bundles`): on GPU every
device of the node, and the CPUs of the node's engines. Ray offers each node what the
allocation gave its task — the GPUs of `--gres=gpu:N` and the CPUs of `--cpus-per-task`
(`mcore-rl ray-run` starts each node's Ray with MCORE_RL_RAY_CPUS or SLURM_CPUS_ON_NODE
CPUs) — and waits for a bundle that does not fit until the start-up deadline. With sbatch's
defaults (train.sbatch: 2 CPUs, no GPU request) a GPU run can never be placed, so the
shortfall is said before anything starts, in one line, from what SLURM put in the
environment:

- SLURM_JOB_ID: inside an allocation (outside one there is nothing to check);
- SLURM_JOB_NUM_NODES (SLURM_NNODES): its nodes;
- SLURM_GPUS_ON_NODE, else SLURM_JOB_GPUS (the ids, counted): the GPUs of this node (none
  when neither is set: no GPU was requested);
- MCORE_RL_RAY_CPUS, else SLURM_CPUS_ON_NODE: the CPUs Ray gets per node.

Every node of an sbatch allocation gets the same per-node options, so the batch script's
node speaks for all of them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class SlurmAllocation:
    """What the allocation offers per node, and the variables it was read from (for the
    message). gpus_per_node 0 with gpu_source None: no GPU was requested."""

    job: str
    nodes: int | None
    gpus_per_node: int
    cpus_per_node: float | None
    gpu_source: str | None
    cpu_source: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SlurmAllocation | None:
        """The allocation this process runs in; None outside one (no SLURM_JOB_ID)."""
        job = env.get("SLURM_JOB_ID")
        if not job:
            return None
        nodes = _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
        gpus, gpu_source = 0, None
        if env.get("SLURM_GPUS_ON_NODE"):
            gpus, gpu_source = _int(env, "SLURM_GPUS_ON_NODE") or 0, "SLURM_GPUS_ON_NODE"
        elif env.get("SLURM_JOB_GPUS"):
            ids = [g for g in env["SLURM_JOB_GPUS"].split(",") if g.strip()]
            gpus, gpu_source = len(ids), "SLURM_JOB_GPUS"
        cpu_source = next((name for name in ("MCORE_RL_RAY_CPUS", "SLURM_CPUS_ON_NODE")
                           if env.get(name)), None)
        cpus = None if cpu_source is None else float(env[cpu_source])
        return cls(job=job, nodes=nodes, gpus_per_node=gpus, cpus_per_node=cpus,
                   gpu_source=gpu_source, cpu_source=cpu_source)


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class Shortfall:
    """What the allocation lacks against the plan (`lacks`), and the least sbatch options that
    give the plan what it needs (`options`)."""

    lacks: str
    options: str


def allocation_shortfall(bundles: Sequence[Mapping[str, float]],
                         allocation: SlurmAllocation | None) -> Shortfall | None:
    """`bundles` (one per node of the plan: `placement.node_bundles`) against the allocation;
    None when every bundle fits (or outside an allocation)."""
    if allocation is None or not bundles:
        return None
    need_nodes = len(bundles)
    need_gpus = int(max(b.get("GPU", 0.0) for b in bundles))
    need_cpus = max(b.get("CPU", 0.0) for b in bundles)
    a = allocation
    lacks = []
    if a.nodes is not None and a.nodes < need_nodes:
        lacks.append(f"{a.nodes} node(s) (SLURM_JOB_NUM_NODES) where the plan spreads over "
                     f"{need_nodes}")
    if need_gpus and a.gpus_per_node < need_gpus:
        have = (f"{a.gpus_per_node} GPU(s) per node ({a.gpu_source}={a.gpus_per_node})"
                if a.gpu_source else "no GPUs (SLURM_GPUS_ON_NODE and SLURM_JOB_GPUS unset: "
                                     "no --gres=gpu:N)")
        lacks.append(f"{have} where the plan needs {need_gpus} per node")
    if a.cpus_per_node is not None and a.cpus_per_node < need_cpus:
        lacks.append(f"{a.cpus_per_node:g} CPU(s) per node for Ray ({a.cpu_source}="
                     f"{a.cpus_per_node:g}) where the plan reserves {need_cpus:g} per node "
                     "(rollout.engines on the node × rollout.cpus_per_engine)")
    if not lacks:
        return None
    options = [f"--nodes={max(need_nodes, a.nodes or 0)}"]
    if need_gpus:
        options.append(f"--gres=gpu:{need_gpus}")
    options.append(f"--cpus-per-task={max(math.ceil(need_cpus), int(a.cpus_per_node or 0))}")
    return Shortfall(lacks=f"SLURM job {a.job} has " + "; ".join(lacks)
                     + ": Ray could never place the run's workers",
                     options="sbatch " + " ".join(options))


__all__ = ["Shortfall", "SlurmAllocation", "allocation_shortfall"]
