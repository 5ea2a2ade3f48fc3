"""One rank's side of the weight-sync world: its groups, its device and its copy services.

Training ranks and vLLM workers both hold a `SyncChannels` (built once per sync group, reused
by every sync): `send` streams a training rank's shards to every engine by that engine's
transport, `receive` yields an inference rank's shards by its engine's transport. The
choices come from the `SyncGroupSpec` (backend, per-engine transports — the resolved run's)
and the rank's device (the resolved run's `actor_devices` / `engine_devices`); nothing here
asks torch what hardware there is.

Groups: `bulk` is the sync group (gloo / NCCL) that p2p messages travel on; `control` is a
gloo group for IPC handles and signals — the bulk group itself when that is gloo. When every
engine is colocated (all "ipc") no bytes use the bulk group, so it is built as gloo whatever
the backend: NCCL would refuse the colocated ranks (two ranks of a group on one device).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from mcore_rl.resharding.copy_service import CopyService, P2PCopy
from mcore_rl.resharding.host_memory import ReceivePool
from mcore_rl.resharding.ipc_copy import IpcCopy
from mcore_rl.resharding.planner import Plan
from mcore_rl.resharding.schedule import ScheduleCache
from mcore_rl.resharding.sync_group import SyncGroupSpec, join_control_group, join_sync_group
from mcore_rl.resharding.transport import SyncStats, receive_shards, send_shards, verify_plan


def engine_transport(spec: SyncGroupSpec, plan: Plan, dst_sync_rank: int) -> str:
    """How inference sync rank `dst_sync_rank` receives: its engine's transport (engines are
    numbered engine-major after the training ranks, all with the same TP)."""
    if not spec.transports:
        return "p2p"
    per_engine, left = divmod(plan.num_dst, len(spec.transports))
    if left:
        raise ValueError(f"SyncGroupSpec.transports names {len(spec.transports)} engines but "
                         f"the plan has {plan.num_dst} inference ranks")
    return spec.transports[(dst_sync_rank - plan.num_src) // per_engine]


@dataclass
class SyncChannels:
    """This rank's groups and copy services on one sync group (see the module docstring)."""

    spec: SyncGroupSpec
    rank: int
    device: torch.device
    bulk: dist.ProcessGroup
    control: dist.ProcessGroup
    _services: dict[str, CopyService] = field(default_factory=dict)
    # this rank's compiled share of each plan it synced, by fingerprint: compiled once
    _schedules: ScheduleCache = field(default_factory=ScheduleCache)
    # host memory one receive assembled into, reused by the next (no first-touch cost)
    _receive_pool: ReceivePool = field(default_factory=ReceivePool)
    # fingerprints of the plans every rank of this group has verified (`verify`)
    _verified: set[bytes] = field(default_factory=set)

    @classmethod
    def join(cls, spec: SyncGroupSpec, rank: int, device: str | torch.device = "cpu",
             store: dist.Store | None = None) -> "SyncChannels":
        """Join as sync rank `rank` (blocks until every rank has joined). device: this rank's
        device ("cpu" or "cuda:<local index>")."""
        if spec.transports and all(t == "ipc" for t in spec.transports):
            spec = replace(spec, backend="gloo")
        bulk = join_sync_group(spec, rank, store)
        control = join_control_group(spec, rank, bulk, store)
        return cls(spec, rank, torch.device(device), bulk, control)

    def service(self, transport: str) -> CopyService:
        """The copy service of `transport`, created on first use and kept."""
        if transport not in self._services:
            if transport == "p2p":
                wire = "cpu" if self.spec.backend == "gloo" else None
                self._services[transport] = P2PCopy(self.bulk, wire_device=wire)
            elif transport == "ipc":
                self._services[transport] = IpcCopy(self.control, self.device)
            else:
                raise ValueError(f"transport {transport!r}: expected 'p2p' or 'ipc'")
        return self._services[transport]

    def verify(self, plan: Plan) -> None:
        """Compare plan fingerprints with every rank (all ranks call it), once per plan and
        group: a plan every rank of this group has already agreed on is not compared again
        (each rank records it only after the exchange succeeded everywhere — a mismatch
        raises on every rank, and a failed sync tears the group down)."""
        fingerprint = plan.fingerprint()
        if fingerprint in self._verified:
            return
        if self.control is not self.bulk or self.spec.backend == "gloo":
            verify_plan(plan, self.control, self.rank, device="cpu")
        else:
            verify_plan(plan, self.bulk, self.rank, device=self.device)
        self._verified.add(fingerprint)

    def send(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
             timeout_s: float) -> dict:
        """Stream this training rank's shards to every engine by its transport. Returns the
        stats (`bytes_sent_<transport>` per transport used). A failure closes the service it
        happened in (its staging goes; the group is torn down after a failed sync)."""
        by_transport: dict[str, set[int]] = {}
        for dst in range(plan.num_src, plan.world_size):
            by_transport.setdefault(engine_transport(self.spec, plan, dst), set()).add(dst)
        total, out = SyncStats(), {}
        for transport in sorted(by_transport):  # any order is deadlock-free: disjoint receivers
            peers = by_transport[transport]
            schedule = self._schedules.get(plan, self.rank, sending=True, peers=peers)
            stats = self._guarded(transport, lambda copy: send_shards(
                plan, self.bulk, self.rank, tensors, dtype=dtype, timeout_s=timeout_s,
                copy=copy, peers=peers, schedule=schedule))
            out[f"bytes_sent_{transport}"] = stats.bytes_sent
            for name in ("bytes_sent", "messages", "zero_copy_messages", "seconds",
                         "peak_extra_bytes"):  # staging of two services may coexist: a sum
                setattr(total, name, getattr(total, name) + getattr(stats, name))
        return {**total.as_dict(), **out}

    def receive(self, plan: Plan, transport: str, *, dtype: torch.dtype, timeout_s: float,
                stats: SyncStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """This inference rank's shards, by its engine's `transport`, on this rank's device.
        Host shards are assembled in the memory the previous receive used
        (`host_memory.ReceivePool`): what this yields is valid until the next `receive` —
        copy what you keep (the vLLM installer copies into the engine's parameters)."""
        copy = self.service(transport)
        try:
            yield from receive_shards(
                plan, self.bulk, self.rank, dtype=dtype, timeout_s=timeout_s, stats=stats,
                device=self.device, copy=copy,
                schedule=self._schedules.get(plan, self.rank, sending=False),
                pool=self._receive_pool)
        except BaseException:
            self._drop(transport)
            self._receive_pool.clear()  # a half-received sync: start over on fresh memory
            raise

    def _guarded(self, transport: str, run):
        try:
            return run(self.service(transport))
        except BaseException:
            self._drop(transport)
            raise

    def _drop(self, transport: str) -> None:
        service = self._services.pop(transport, None)
        if service is not None:
            service.close()

    def close(self) -> None:
        """Free staging buffers and shut the groups down."""
        for transport in list(self._services):
            self._drop(transport)
        self._receive_pool.clear()
        if self.control is not self.bulk:
            self.control.shutdown()
        self.bulk.shutdown()


__all__ = ["SyncChannels", "engine_transport"]
