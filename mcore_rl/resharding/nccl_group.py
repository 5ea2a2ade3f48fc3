"""The sync group's bytes on GPU: point-to-point NCCL through vLLM's `PyNcclCommunicator`, one
grouped launch per transfer round, and no c10d watchdog.

Why not torch's ProcessGroupNCCL: its watchdog (`TORCH_NCCL_ASYNC_ERROR_HANDLING`) tears the
process down when an operation times out or a peer dies — a dead engine would take the
trainers and the surviving engines with it instead of being restarted — and it builds a
2-rank communicator per (sender, receiver) pair on first use. Here each rank joins a few
communicators up front, a round's sends and receives go out between `ncclGroupStart` and
`ncclGroupEnd` on the group's own stream, and a deadline that passes raises `SyncError`
(the caller tears the group down and `shutdown` aborts the communicators). Without the
watchdog, nobody else polls NCCL's asynchronous errors: a round's wait does
(`ncclCommGetAsyncError`, every 10 ms), so a peer NCCL sees die fails the sync at once,
naming it, instead of at the deadline (600–1200 s in the GPU configs).

Communicators (`communicators`): one over the whole sync world when no device holds two sync
ranks (engines on their own devices). Colocated engines share each device with an actor rank
(they take their own node's shards by CUDA IPC) and NCCL refuses a communicator holding two
ranks of one device; their bytes from other nodes then go through one communicator per
(actor node a, engine node b ≠ a): a's actor ranks and b's engine ranks, every member on its
own device. Every rank creates its communicators in one global order, so none waits on a
peer that waits on it.

Rendezvous: the sync group's TCPStore carries each communicator's NCCL unique id as raw
bytes (`PyNcclCommunicator.from_unique_id_bytes`) — nothing is pickled.
"""

from __future__ import annotations

import ctypes
import datetime
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mcore_rl.compat.vllm_pynccl import pynccl
from mcore_rl.resharding.sync_group import SyncGroupSpec

# polling a round's completion event: short enough to add little to a round
_POLL_S = 0.0002
# polling the communicators' asynchronous errors while a round is in flight
_ERROR_POLL_S = 0.01
# NCCL's ncclResult_t (nccl.h): 0 is success and 7 (ncclInProgress) an op still running
_NCCL_RESULTS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                 4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError"}


def communicators(spec: SyncGroupSpec) -> list[tuple[int, ...]]:
    """The member sync ranks of every communicator this world needs, in creation order
    (module doc). The actor ranks are sync ranks 0..spec.actor_ranks-1; engines follow."""
    world, num_src = tuple(range(spec.world_size)), spec.actor_ranks
    if "ipc" not in spec.transports:  # no device holds two sync ranks
        return [world]
    if not 0 < num_src < spec.world_size:
        raise ValueError(f"SyncGroupSpec.actor_ranks={num_src}: colocated engines need the "
                         "number of actor ranks to cut NCCL communicators by")
    nodes = spec.nodes or (0,) * spec.world_size
    actor_nodes = sorted({nodes[r] for r in range(num_src)})
    engine_nodes = sorted({nodes[r] for r in range(num_src, spec.world_size)})
    out = []
    for a in actor_nodes:
        for b in engine_nodes:
            if a != b:
                out.append(tuple(r for r in range(num_src) if nodes[r] == a) +
                           tuple(r for r in range(num_src, spec.world_size) if nodes[r] == b))
    return out


@dataclass
class RoundWork:
    """The completion of one launched round, for every op posted in it (`wait_work`'s API).
    While it waits it also polls the communicators' asynchronous errors
    (`NcclP2PGroup.async_error`): a peer that died or a network fault fails the wait as soon
    as NCCL sees it, not at the deadline — `wait_work` then names the round and the peer."""

    group: "NcclP2PGroup"
    round_index: int

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        event = self.group.events.get(self.round_index)
        if event is None:
            raise RuntimeError(f"round {self.round_index} was never launched")
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        next_check = 0.0
        while not event.query():
            now = time.monotonic()
            if now >= next_check:
                error = self.group.async_error()
                if error is not None:
                    raise RuntimeError(f"NCCL transfers of round {self.round_index} failed: "
                                       f"{error}")
                next_check = now + _ERROR_POLL_S
            if deadline is not None and now > deadline:
                raise TimeoutError(f"NCCL transfers of round {self.round_index} not complete "
                                   f"after {timeout.total_seconds():.0f} s")
            time.sleep(_POLL_S)
        return True


class NcclP2PGroup:
    """This rank's communicators of the sync world and its queued p2p operations.

    `send` / `recv` queue an op (NCCL matches a pair's ops in the order they are posted, which
    the plan fixes on both sides, so `tag` is unused); `launch_round` issues every queued op
    as one NCCL group per communicator on the group's stream and records the event their
    `RoundWork` waits for. `make_comm(unique_id, rank, world, device)` and `mint_id()` are
    vLLM's (`PyNcclCommunicator.from_unique_id_bytes`, `NCCLLibrary.ncclGetUniqueId`);
    `error_reader(comm)` returns a function that reads the communicator's asynchronous error,
    an `ncclResult_t` (NCCL's `ncclCommGetAsyncError`, which vLLM's wrapper does not bind:
    `_nccl_error_reader`)."""

    def __init__(self, spec: SyncGroupSpec, rank: int, store, device: torch.device, *,
                 make_comm: Callable | None = None,
                 mint_id: Callable[[], bytes] | None = None,
                 error_reader: Callable[[object], Callable[[], int]] | None = None):
        self.rank, self.device = rank, torch.device(device)
        make_comm, mint_id = make_comm or _pynccl_comm, mint_id or _new_unique_id
        self._error_reader = error_reader or _nccl_error_reader
        self._errors: list[Callable[[], int]] | None = None  # one reader per communicator
        self.comms: list = []
        self.members: list[tuple[int, ...]] = []  # each communicator's sync ranks
        self.peer: dict[int, tuple[int, int]] = {}  # sync rank → (communicator, its rank)
        for c, members in enumerate(communicators(spec)):
            if rank not in members:
                continue
            key = f"nccl/{c}"
            me = members.index(rank)
            if me == 0:
                store.set(key, mint_id())
            comm = make_comm(bytes(store.get(key)), me, len(members), self.device)
            if getattr(comm, "disabled", False):  # pynccl off (VLLM_DISABLE_PYNCCL, no libnccl)
                raise RuntimeError(f"sync rank {rank}: vLLM's PyNccl is disabled here, so the "
                                   "NCCL sync group cannot carry weights")
            for i, member in enumerate(members):
                if member != rank:
                    self.peer.setdefault(member, (len(self.comms), i))
            self.comms.append(comm)
            self.members.append(tuple(members))
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.events: dict[int, object] = {}
        self._queued: list[tuple[str, torch.Tensor, int, int]] = []  # op, tensor, comm, peer
        self._round = 0

    def _route(self, peer: int) -> tuple[int, int]:
        if peer not in self.peer:
            raise ValueError(f"sync rank {self.rank} shares no NCCL communicator with sync "
                             f"rank {peer} (a same-node pair of a colocated engine moves by "
                             "IPC, not over the sync group)")
        return self.peer[peer]

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int = 0) -> RoundWork:
        self._queued.append(("send", tensors[0], *self._route(dst)))
        return RoundWork(self, self._round)

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int = 0) -> RoundWork:
        self._queued.append(("recv", tensors[0], *self._route(src)))
        return RoundWork(self, self._round)

    def launch_round(self) -> None:
        """Issue the queued ops: one NCCL group per communicator, after the work already queued
        on the current stream (which wrote the staging the sends read)."""
        queued, self._queued = self._queued, []
        by_comm: dict[int, list[tuple[str, torch.Tensor, int]]] = {}
        for op, tensor, c, peer_rank in queued:
            by_comm.setdefault(c, []).append((op, tensor, peer_rank))
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for c, ops in sorted(by_comm.items()):
                comm = self.comms[c]
                comm.group_start()
                for op, tensor, peer_rank in ops:
                    if op == "send":
                        comm.send(tensor, peer_rank, stream)
                    else:
                        comm.recv(tensor, peer_rank, stream)
                    tensor.record_stream(stream)
                comm.group_end()
            event = torch.cuda.Event()
            event.record(stream)
        # a round is waited for before the one two launches later is posted (P2PCopy's
        # window); keep a margin of events beyond that
        self.events[self._round] = event
        self.events.pop(self._round - 4, None)
        self._round += 1

    def async_error(self) -> str | None:
        """The first asynchronous error NCCL reports on one of this rank's communicators
        (a dead peer, a network fault, a failed kernel), naming the communicator's sync
        ranks; None while all is well."""
        if self._errors is None:
            self._errors = [self._error_reader(comm) for comm in self.comms]
        for read, members in zip(self._errors, self.members):
            code = read()
            if code not in (0, 7):  # ncclSuccess, ncclInProgress
                return (f"{_NCCL_RESULTS.get(code, f'ncclResult {code}')} on the communicator "
                        f"of sync ranks {list(members)} (a member died or its link failed)")
        return None

    def shutdown(self) -> None:
        """Abort every communicator (vLLM's `destroy`: ncclCommAbort, bounded)."""
        comms, self.comms, self.members, self._errors = self.comms, [], [], None
        for comm in comms:
            comm.destroy()


def _pynccl_comm(unique_id: bytes, rank: int, world: int, device: torch.device):
    communicator, _ = pynccl()  # vLLM's import leaves a trainer rank's environment as it was
    return communicator.PyNcclCommunicator.from_unique_id_bytes(unique_id, rank, world, device)


def _nccl_error_reader(comm) -> Callable[[], int]:
    """A function returning `ncclCommGetAsyncError(comm, &result)` of a vLLM
    `PyNcclCommunicator` (an error of the call itself is returned as the result). The library
    vLLM loaded (`comm.nccl.lib`) exports it, but vLLM 0.32's `NCCLLibrary` does not bind it:
    a ctypes prototype of our own calls it, changing nothing of vLLM's."""
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
    call, handle = prototype(("ncclCommGetAsyncError", comm.nccl.lib)), comm.comm

    def read() -> int:
        result = ctypes.c_int(0)
        return call(handle, ctypes.byref(result)) or result.value

    return read


def _new_unique_id() -> bytes:
    _, wrapper = pynccl()
    return bytes(wrapper.NCCLLibrary().ncclGetUniqueId().internal)


__all__ = ["NcclP2PGroup", "RoundWork", "communicators"]
