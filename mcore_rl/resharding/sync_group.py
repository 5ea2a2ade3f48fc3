"""The weight-sync group: one process group spanning training ranks and inference ranks.

Trainers and vLLM workers live in different torch.distributed worlds (each has its own default
group), so the sync group is built outside both, from a `TCPStore` that sync rank 0 (training
rank 0) hosts: trainer ranks are sync ranks 0..T-1, inference ranks T.. (engine-major).
Every group gets a fresh prefix so that a torn-down group can be re-formed after a failure.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace

import torch.distributed as dist

from mcore_rl.launch.listen import listening_store


@dataclass(frozen=True)
class SyncGroupSpec:
    """Where and how to build a sync group; picklable, so it can be sent to vLLM workers.

    host/port: the TCPStore hosted by sync rank 0 (binds 127.0.0.1 unless configured).
    prefix: unique per group incarnation (re-forming after a failure uses a new prefix).
    world_size: trainer ranks + inference ranks. timeout_s: every send/recv deadline.
    backend: the group's ("gloo" on CPU, "nccl" on GPU; the resolved run's `sync_backend`).
    transports: per engine, how it receives — "p2p" (sends on this group) or "ipc" (shared
    staging buffers, colocated ranks; the resolved run's `transports`); empty: all p2p. On a
    non-gloo group every rank also joins a gloo control group (`join_control_group`).
    nodes: the node of every sync rank (the resolved run's `sync_nodes`); empty: one node.
    An "ipc" engine receives by IPC only from sources on its own node (`pair_transport`):
    a staging buffer's handle cannot be opened on another node.
    actor_ranks: how many of the sync ranks are actor ranks (the senders; 0: not given) —
    what the NCCL p2p group (`nccl_group.py`) cuts its communicators by.
    """

    host: str
    port: int
    prefix: str
    world_size: int
    timeout_s: float = 120.0
    backend: str = "gloo"
    transports: tuple[str, ...] = ()
    nodes: tuple[int, ...] = ()
    actor_ranks: int = 0

    def __post_init__(self):
        bad = [t for t in self.transports if t not in ("p2p", "ipc")]
        if bad:
            raise ValueError(f"SyncGroupSpec.transports: {bad} — expected 'p2p' or 'ipc' per "
                             "engine")

        if self.nodes and len(self.nodes) != self.world_size:
            raise ValueError(f"SyncGroupSpec.nodes: {len(self.nodes)} nodes for a world of "
                             f"{self.world_size} sync ranks")

    def engine_transport(self, plan, dst_sync_rank: int) -> str:
        """How inference sync rank `dst_sync_rank`'s engine receives (engines are numbered
        engine-major after the training ranks, all with the same TP)."""
        if not self.transports:
            return "p2p"
        per_engine, left = divmod(plan.num_dst, len(self.transports))
        if left:
            raise ValueError(f"SyncGroupSpec.transports names {len(self.transports)} engines "
                             f"but the plan has {plan.num_dst} inference ranks")
        return self.transports[(dst_sync_rank - plan.num_src) // per_engine]

    def pair_transport(self, plan, src_sync_rank: int, dst_sync_rank: int) -> str:
        """How the transfers from `src_sync_rank` to `dst_sync_rank` move: the destination
        engine's transport, except that IPC never crosses a node (such a pair goes p2p)."""
        transport = self.engine_transport(plan, dst_sync_rank)
        if transport == "ipc" and self.nodes and \
                self.nodes[src_sync_rank] != self.nodes[dst_sync_rank]:
            return "p2p"
        return transport

    @property
    def all_ipc(self) -> bool:
        """No byte travels on the sync group: every engine colocated, all on one node."""
        return bool(self.transports) and all(t == "ipc" for t in self.transports) and \
            len(set(self.nodes)) <= 1

    @property
    def needs_control_group(self) -> bool:
        """A gloo group beside a non-gloo sync group: IPC signals and handles need one, and
        the plan fingerprints travel on it so that comparing them never builds a full-world
        NCCL communicator. A gloo sync group is its own."""
        return self.backend != "gloo"


def host_store(host: str = "127.0.0.1", port: int = 0, world_size: int = 1,
               timeout_s: float = 120.0) -> dist.TCPStore:
    """Start the TCPStore the sync group rendezvouses on (call on sync rank 0 only). It
    listens on `host` only (`launch.listen`). `port=0` lets the OS choose; read the chosen
    one from `.port`."""
    return listening_store(host, port, world_size, timeout_s=timeout_s)


def prefixed_store(spec: SyncGroupSpec, store: dist.Store | None = None) -> dist.Store:
    """The sync group's store under its prefix: `store` (rank 0 passes the one it hosts), else
    a client of the spec's TCPStore."""
    if store is None:
        store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
    return dist.PrefixStore(spec.prefix, store)


def join_sync_group(spec: SyncGroupSpec, rank: int,
                    store: dist.Store | None = None) -> dist.ProcessGroup:
    """Build this rank's handle on the sync group as a torch process group (collectives too:
    the benchmark's baseline). Blocks until all ranks have joined or the timeout passes. Rank
    0 passes the store it hosts; everyone else connects as a client. The weight sync's own
    bytes on NCCL travel on `nccl_group.NcclP2PGroup` instead (`SyncChannels.join`)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    prefixed = prefixed_store(spec, store)
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


def sync_group_spec(run, *, host: str, port: int, prefix: str, timeout_s: float,
                    engines: int | None = None) -> SyncGroupSpec:
    """The sync group of a resolved run (`mcore_rl.runconfig.resolve.ResolvedRun`): its world
    is the run's actor ranks plus the TP ranks of its first `engines` engines (default: all;
    fewer while late engines are still starting), its backend the run's `sync_backend` —
    never re-derived here."""
    world = len(run.actor_devices) + sum(len(e) for e in run.engine_devices[:engines])
    return SyncGroupSpec(host, port, prefix, world, timeout_s, backend=run.sync_backend,
                         transports=tuple(run.transports)[:engines],
                         nodes=run.sync_nodes(engines), actor_ranks=len(run.actor_devices))


def join_control_group(spec: SyncGroupSpec, rank: int, bulk: dist.ProcessGroup,
                       store: dist.Store | None = None) -> dist.ProcessGroup:
    """The gloo group that carries IPC handles, round signals and the plan fingerprints:
    `bulk` itself when that is gloo; else a gloo group over the same ranks (prefix + "ctl/").
    Every rank of the sync world calls it, right after `join_sync_group`."""
    if not spec.needs_control_group:
        return bulk
    return join_sync_group(replace(spec, backend="gloo", prefix=spec.prefix + "ctl/"), rank,
                           store)

