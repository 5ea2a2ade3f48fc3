"""One rank's side of the weight-sync world: its groups, its device and its copy services.

Training ranks and vLLM workers both hold a `SyncChannels` (built once per sync group, reused
by every sync): `send` streams a training rank's shards to every engine by that engine's
transport, `receive` yields an inference rank's shards by its engine's transport. The
choices come from the `SyncGroupSpec` (backend, per-engine transports — the resolved run's)
and the rank's device (the resolved run's `actor_devices` / `engine_devices`); nothing here
asks torch what hardware there is.

Transports are per (source, destination) pair (`SyncGroupSpec.pair_transport`): the
destination engine's, except that IPC never crosses a node — a colocated engine gets what its
own node holds through CUDA IPC and the rest over the sync group. A rank whose peers use both
drives them through one `RoutedCopy`, round by round.

Groups: `bulk` is the sync group that p2p messages travel on (gloo, or on NCCL vLLM's PyNccl
communicators, `nccl_group.py`); `control` is a
gloo group for IPC handles, signals and plan fingerprints — the bulk group itself when that
is gloo (fingerprints on an NCCL group would build a communicator over the whole world). When every
engine is colocated on one node (`SyncGroupSpec.all_ipc`) no bytes use the bulk group, so it
is built as gloo whatever the backend: NCCL would refuse the colocated ranks (two ranks of a
group on one device) in a collective. On more nodes the bulk group carries the cross-node
pairs, whose point-to-point communicators never hold two ranks of one device.

Every sync is verified: `send` digests what it sends, `receive` what its caller installed, and
both end with one all-reduce of the digests on `control` that fails the sync on every rank,
naming the tensor and the ranks, when they differ (digest.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from mcore_rl.resharding.copy_service import CopyService, P2PCopy, SyncError, wait_work
from mcore_rl.resharding.digest import DigestLedger, DigestTally
from mcore_rl.resharding.fp8 import (block_parts, block_quantized_sources, fp8_parts,
                                     installed_scales, quantized_sources, sent_amax)
from mcore_rl.resharding.host_memory import ReceivePool
from mcore_rl.resharding.ipc_copy import IpcCopy
from mcore_rl.resharding.planner import Plan
from mcore_rl.resharding.routed_copy import RoutedCopy
from mcore_rl.resharding.schedule import ScheduleCache
from mcore_rl.resharding.nccl_group import NcclP2PGroup
from mcore_rl.resharding.sync_group import (SyncGroupSpec, join_control_group, join_sync_group,
                                            prefixed_store)
from mcore_rl.resharding.stats import SyncStats
from mcore_rl.resharding.transport import ReceiveTarget, receive_shards, send_shards, verify_plan


def engine_transport(spec: SyncGroupSpec, plan: Plan, dst_sync_rank: int) -> str:
    """How inference sync rank `dst_sync_rank`'s engine receives from its own node (engines
    are numbered engine-major after the training ranks, all with the same TP)."""
    return spec.engine_transport(plan, dst_sync_rank)


def pair_transport(spec: SyncGroupSpec, plan: Plan, src_sync_rank: int,
                   dst_sync_rank: int) -> str:
    """How the transfers of one (source, destination) pair move: the engine's transport, but
    never IPC across nodes (`SyncGroupSpec.pair_transport`)."""
    return spec.pair_transport(plan, src_sync_rank, dst_sync_rank)


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
    # each synced plan's digest slots (digest.py), by fingerprint; the receive in flight's tally
    _ledgers: dict[bytes, DigestLedger] = field(default_factory=dict)
    _receiving: DigestTally | None = None
    # FP8 scales a receive yields after its transfers: computed here from the amax exchange,
    # not moved, so not digested when installed
    _computed: frozenset[str] = frozenset()

    @classmethod
    def join(cls, spec: SyncGroupSpec, rank: int, device: str | torch.device = "cpu",
             store: dist.Store | None = None) -> "SyncChannels":
        """Join as sync rank `rank` (blocks until every rank has joined). device: this rank's
        device ("cpu" or "cuda:<local index>")."""
        if spec.all_ipc:
            spec = replace(spec, backend="gloo")
        if spec.backend == "nccl":  # p2p on vLLM's PyNccl: no c10d watchdog (nccl_group.py)
            bulk = NcclP2PGroup(spec, rank, prefixed_store(spec, store), torch.device(device))
        else:
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

    def verify(self, plan: Plan, problem: str | None = None) -> None:
        """Compare plan fingerprints with every rank (all ranks call it), once per plan and
        group: a plan every rank of this group has already agreed on is not compared again
        (each rank records it only after the exchange succeeded everywhere — a mismatch
        raises on every rank, and a failed sync tears the group down).
        problem: why this rank cannot take the plan (its parameters do not match): it still
        takes part, so that every rank fails at once naming it (`verify_plan`)."""
        fingerprint = plan.fingerprint()
        if fingerprint in self._verified:
            if problem is not None:  # the group agreed on it before: shapes cannot have changed
                raise SyncError(f"{plan.label(self.rank)}: {problem}")
            return
        verify_plan(plan, self.control, self.rank, device="cpu",  # gloo, whatever the bulk
                    problem=problem)
        self._verified.add(fingerprint)

    def _ledger(self, plan: Plan) -> DigestLedger:
        fingerprint = plan.fingerprint()
        if fingerprint not in self._ledgers:
            if len(self._ledgers) >= 4:  # a run has one plan (two with LoRA adapter syncs)
                self._ledgers.pop(next(iter(self._ledgers)))
            self._ledgers[fingerprint] = DigestLedger(plan)
        return self._ledgers[fingerprint]

    def send(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
             timeout_s: float) -> dict:
        """Stream this training rank's shards to every engine by its transport. Returns the
        stats (`bytes_sent_<transport>` per transport used). A failure closes the service it
        happened in (its staging goes; the group is torn down after a failed sync).

        FP8 engines (`plan.fp8`): every sync rank all-reduces each logical FP8 tensor's amax
        (the senders' regions, in the engines' `dtype`), then this rank sends the rest of its
        shards and, in one byte per element, its regions of FP8 tensors quantized with their
        tensor's scale (`resharding/fp8.py`)."""
        if plan.fp8 is None:
            return self._send(plan, tensors, dtype=dtype, timeout_s=timeout_s)
        if plan.fp8.scheme == "fp8_per_block":
            return self._send_blocks(plan, tensors, dtype=dtype, timeout_s=timeout_s)
        rest, quantized = fp8_parts(plan)
        amax = self._all_amax(sent_amax(plan, self.rank, tensors, dtype))
        stats = self._send(rest, tensors, dtype=dtype, timeout_s=timeout_s)
        sources = quantized_sources(plan, self.rank, tensors, dtype, amax)
        part = self._send(quantized, sources, dtype=torch.uint8, timeout_s=timeout_s)
        # the one-byte copy it sends from is held through that part (the memory plan's
        # weight-sync phase counts it)
        part["peak_extra_bytes"] += sum(t.numel() for t in sources.values())
        return _summed(stats, part)

    def _send_blocks(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *,
                     dtype: torch.dtype, timeout_s: float) -> dict:
        """Block-wise FP8 (`resharding/fp8.block_parts`): the shards in `dtype`, then the block
        scales of every region this rank quantizes, then those regions (one byte per
        element): an engine rank holds the scales, a few bytes, when each weight lands."""
        rest, quantized, scales = block_parts(plan)
        stats = self._send(rest, tensors, dtype=dtype, timeout_s=timeout_s)
        regions, region_scales = block_quantized_sources(plan, self.rank, tensors, dtype)
        for part, sources, wire in ((scales, region_scales, torch.float32),
                                    (quantized, regions, torch.uint8)):
            sent = self._send(part, sources, dtype=wire, timeout_s=timeout_s)
            stats = _summed(stats, sent)
        # the quantized copies are held through both parts (the memory plan's weight-sync
        # phase counts them)
        stats["peak_extra_bytes"] += sum(t.numel() for t in regions.values()) + sum(
            t.numel() * t.element_size() for t in region_scales.values())
        return stats

    def _all_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The MAX of every sync rank's `amax` (an engine rank gives zeros), on the control
        group: each logical FP8 tensor's largest magnitude, on every rank."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        amax = amax.cpu().contiguous()
        wait_work(self.control.allreduce([amax], opts), "FP8 amax exchange",
                  self.spec.timeout_s)
        return amax

    def _send(self, plan: Plan, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
              timeout_s: float) -> dict:
        by_transport: dict[str, set[int]] = {}
        for dst in range(plan.num_src, plan.world_size):
            by_transport.setdefault(self.spec.pair_transport(plan, self.rank, dst),
                                    set()).add(dst)
        used = sorted(t for t, peers in by_transport.items()
                      if any(self._schedules.get(plan, self.rank, sending=True,
                                                 peers=peers).rounds))
        digests = self._ledger(plan).tally(self.device, sending=True)
        if len(used) > 1:  # both kinds of peers: one round-ordered pass through both
            route = {dst: t for t, peers in by_transport.items() for dst in peers}
            schedule = self._schedules.get(plan, self.rank, sending=True)
            copy = self._routed(used, route)
            stats = self._guarded_all(used, lambda: send_shards(
                plan, self.bulk, self.rank, tensors, dtype=dtype, timeout_s=timeout_s,
                copy=copy, schedule=schedule, digests=digests))
            out = {f"bytes_sent_{t}": copy.sub_stats[t].bytes_sent for t in used}
        else:
            stats, out = SyncStats(), {}
            for transport in sorted(by_transport):  # one kind of peer per round-ordered pass
                peers = by_transport[transport]
                schedule = self._schedules.get(plan, self.rank, sending=True, peers=peers)
                part = self._guarded(transport, lambda copy: send_shards(
                    plan, self.bulk, self.rank, tensors, dtype=dtype, timeout_s=timeout_s,
                    copy=copy, peers=peers, schedule=schedule, digests=digests))
                out[f"bytes_sent_{transport}"] = part.bytes_sent
                for name in ("bytes_sent", "messages", "zero_copy_messages", "seconds",
                             "peak_extra_bytes"):  # staging of two services may coexist: a sum
                    setattr(stats, name, getattr(stats, name) + getattr(part, name))
        digests.compare(self.control, self.rank)  # after every receiver installed its shards
        stats.digest_seconds, stats.compare_seconds = digests.seconds, digests.compare_seconds
        return {**stats.as_dict(), **out}

    def receive(self, plan: Plan, transport: str | None = None, *, dtype: torch.dtype,
                timeout_s: float, stats: SyncStats | None = None,
                into: ReceiveTarget | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """This inference rank's shards (`_receive`). FP8 engines (`plan.fp8`), each weight's
        scales before it: per tensor, after the amax exchange (`send`), this rank's scale
        parameters (fp32, computed here), the shards kept in `dtype`, then the FP8 weights
        (uint8, their bytes); block-wise, the shards kept in `dtype`, the senders' block
        scales, then the FP8 weights."""
        if plan.fp8 is None:
            yield from self._receive(plan, transport, dtype=dtype, timeout_s=timeout_s,
                                     stats=stats, into=into)
            return
        if plan.fp8.scheme == "fp8_per_block":  # no exchange: each block is its own
            rest, quantized, scales = block_parts(plan)
            for part, wire in ((rest, dtype), (scales, torch.float32),
                               (quantized, torch.uint8)):
                yield from self._receive(part, transport, dtype=wire, timeout_s=timeout_s,
                                         stats=stats, into=into)
            return
        rest, quantized = fp8_parts(plan)
        amax = self._all_amax(torch.zeros(plan.fp8.count, dtype=torch.float32))
        scales = installed_scales(plan, self.rank, amax, dtype)
        self._computed = frozenset(name for name, _ in scales)
        try:  # the scales first: an engine rank holds them when each weight lands
            yield from scales
        finally:
            self._computed = frozenset()
        for part, wire in ((rest, dtype), (quantized, torch.uint8)):
            yield from self._receive(part, transport, dtype=wire, timeout_s=timeout_s,
                                     stats=stats, into=into)

    def _receive(self, plan: Plan, transport: str | None = None, *, dtype: torch.dtype,
                 timeout_s: float, stats: SyncStats | None = None,
                 into: ReceiveTarget | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """This inference rank's shards, each source pair by its transport
        (`SyncGroupSpec.pair_transport`: the engine's, p2p from other nodes), on this rank's
        device. transport: the engine's transport as the caller knows it (checked against the
        spec's; None: the spec's).
        Host shards are assembled in the memory the previous receive used
        (`host_memory.ReceivePool`): what this yields is valid until the next `receive` —
        copy what you keep (the vLLM installer copies into the engine's parameters).
        into: where a wholly covered shard is received straight into (the engine's own
        parameter, `rollout.install.receive_target`), see `receive_shards`.

        Verified, always (digest.py): once the caller is done with a tensor (it asks for the
        next), its digest is taken — of what the caller reported installing (`installed`),
        else of the tensor itself — and after the last one every rank of the group compares
        what the senders sent with what was installed; a mismatch raises SyncError naming
        the tensor and the ranks. A caller that fails between two tensors reports it
        (`fail`), so that no rank waits for it."""
        engine = self.spec.engine_transport(plan, self.rank)
        if transport is not None and transport != engine:
            raise ValueError(f"sync rank {self.rank}: receive by {transport!r}, but its engine's "
                             f"transport is {engine!r}")
        route = {src: self.spec.pair_transport(plan, src, self.rank)
                 for src in range(plan.num_src)}
        schedule = self._schedules.get(plan, self.rank, sending=False)
        used = sorted({route[src] for msgs in schedule.rounds for src, _ in msgs})
        if len(used) > 1:
            copy, drop = self._routed(used, route), used
        else:
            copy, drop = self.service(used[0] if used else engine), used or [engine]
        digests = self._ledger(plan).tally(self.device, sending=False)
        self._receiving = digests
        try:
            for key, tensor in receive_shards(
                    plan, self.bulk, self.rank, dtype=dtype, timeout_s=timeout_s, stats=stats,
                    device=self.device, copy=copy, schedule=schedule, pool=self._receive_pool,
                    into=into):
                yield key, tensor
                if not digests.installed(key):  # the caller kept it as it is
                    digests.add_installed(self.rank, key, tensor)
        except BaseException:
            for name in drop:
                self._drop(name)
            self._receive_pool.clear()  # a half-received sync: start over on fresh memory
            raise
        finally:
            if self._receiving is digests:
                self._receiving = None
        digests.compare(self.control, self.rank)
        if stats is not None:  # summed over an FP8 sync's two parts
            stats.digest_seconds += digests.seconds
            stats.compare_seconds += digests.compare_seconds

    def installed(self, key: str, tensor: torch.Tensor) -> None:
        """During `receive`: `key` now lives in `tensor` (the engine's parameter it was copied
        into, in the per-rank layout the plan describes): its digest is taken from there."""
        if key in self._computed:
            return
        if self._receiving is None:
            raise RuntimeError(f"sync rank {self.rank}: installed({key!r}) outside a receive")
        self._receiving.add_installed(self.rank, key, tensor)

    def fail(self, plan: Plan, reason: str) -> None:
        """This inference rank could not finish receiving `plan` (after the transport
        delivered, e.g. an install error): it still takes part in the sync's digest
        comparison, saying so, so that every rank fails now, naming it, instead of waiting
        for it until the deadline. Raises SyncError."""
        self._ledger(plan).tally(self.device, sending=False).compare(
            self.control, self.rank, failed=reason)

    def transports_used(self, plan: Plan) -> list[str]:
        """The transports this inference rank receives by in `plan` (sorted)."""
        schedule = self._schedules.get(plan, self.rank, sending=False)
        return sorted({self.spec.pair_transport(plan, src, self.rank)
                       for msgs in schedule.rounds for src, _ in msgs})

    def _routed(self, transports: list[str], route: dict[int, str]) -> RoutedCopy:
        return RoutedCopy({t: self.service(t) for t in transports}, route.__getitem__)

    def _guarded_all(self, transports: list[str], run):
        try:
            return run()
        except BaseException:
            for transport in transports:
                self._drop(transport)
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


def _summed(a: dict, b: dict) -> dict:
    """Two sends' stats as one: counts and seconds added (peak staging: the larger)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = max(out.get(key, 0), value) if key == "peak_extra_bytes" else \
            out.get(key, 0) + value
    return out


__all__ = ["SyncChannels", "engine_transport", "pair_transport"]

