"""The weight-sync group: one process group spanning training ranks and inference ranks.

Trainers and vLLM workers live in different torch.distributed worlds (each has its own default
group), so the sync group is built outside both, from a `TCPStore` that sync rank 0 (training
rank 0) hosts: trainer ranks are sync ranks 0..T-1, inference ranks T.. (engine-major).
Every group gets a fresh prefix so that a torn-down group can be re-formed after a failure.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SyncGroupSpec:
    """Where and how to build a sync group; picklable, so it can be sent to vLLM workers.

    host/port: the TCPStore hosted by sync rank 0 (binds 127.0.0.1 unless configured).
    prefix: unique per group incarnation (re-forming after a failure uses a new prefix).
    world_size: trainer ranks + inference ranks. timeout_s: every send/recv deadline.
    """

    host: str
    port: int
    prefix: str
    world_size: int
    timeout_s: float = 120.0
    backend: str = "gloo"


def host_store(host: str = "127.0.0.1", port: int = 0, world_size: int = 1,
               timeout_s: float = 120.0) -> dist.TCPStore:
    """Start the TCPStore the sync group rendezvouses on (call on sync rank 0 only). It
    listens on `host` only (`launch.listen`). `port=0` lets the OS choose; read the chosen
    one from `.port`."""
    from mcore_rl.launch.listen import listening_store

    return listening_store(host, port, world_size, timeout_s=timeout_s)


def join_sync_group(spec: SyncGroupSpec, rank: int,
                    store: dist.Store | None = None) -> dist.ProcessGroup:
    """Build this rank's handle on the sync group. Blocks until all ranks have joined or the
    timeout passes. Rank 0 passes the store it hosts; everyone else connects as a client."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False,
                              timeout=timeout)
    prefixed = dist.PrefixStore(spec.prefix, store)
    if spec.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # Bind gloo to this node's address (MCORE_RL_NODE_IP, set per node by the SLURM
        # launcher) — on one machine the store's loopback — rather than whatever the hostname
        # resolves to.
        local = os.environ.get("MCORE_RL_NODE_IP", spec.host)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local)]
        return dist.ProcessGroupGloo(prefixed, rank, spec.world_size, opts)
    if spec.backend == "nccl":  # pragma: no cover - GPU only
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
    raise ValueError(f"sync backend {spec.backend!r}: expected 'gloo' (CPU) or 'nccl' (GPU)")


def default_sync_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"
