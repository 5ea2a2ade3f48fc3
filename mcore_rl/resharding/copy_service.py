"""How one round of a resharding plan moves its bytes: the pluggable data path of the transport.

The transport (`transport.py`) walks the plan round by round, resolves every message to tensor
views (source slices on a training rank, destination slices on an inference rank) and does all
the checking; a copy service only moves one round's messages:

- `P2PCopy`: send/recv on the sync group (gloo on CPU, NCCL on GPU). A message that is one
  contiguous view already on the wire's device goes out / lands as is (zero copy); otherwise it
  is packed into / received into a staging buffer on the wire's device.
- `IpcCopy` (`ipc_copy.py`): colocated ranks. Each training rank owns one shared staging buffer
  (shared memory on CPU, a CUDA-IPC-shared tensor on GPU) that its receivers map once; per round
  it writes its messages there and signals over a gloo group, and the receivers copy straight
  into their destination tensors and signal back. No bytes cross a process group.

Why not megatron-core's `CopyService` as is (megatron/core/resharding/copy_services): its
`submit_send / submit_recv / run` posts a whole plan as one batch inside one torch.distributed
world, with one receive buffer per op alive at once, and its gloo service assumes CUDA (a copy
stream at init). We keep its idea — the plan executor does not know how bytes move — but cut
it at the round: a round is the unit that bounds staging to one bucket, and the receiver must
see each message land (to yield tensors as they complete) rather than one `run()` at the end.
"""

from __future__ import annotations

import datetime
import time
from abc import ABC, abstractmethod
from typing import Collection, Iterator, Sequence

import torch
import torch.distributed as dist

from mcore_rl.resharding.host_memory import empty_host
from mcore_rl.resharding.planner import Plan
from mcore_rl.resharding.stats import SyncStats

# One message of a round: (peer sync rank, the views it carries, in plan order). Send side:
# slices of the training rank's parameters; receive side: slices of the destination tensors.
Message = tuple[int, Sequence[torch.Tensor]]


class SyncError(RuntimeError):
    """Weight sync failed; the message names the peer rank, round and direction."""


class CopyService(ABC):
    """Moves the messages of one round between this rank and its peers.

    `start` is called once per sync (before round 0) with the plan and the stats to fill;
    `finish` once after the last round (also on failure). A service lives as long as the sync
    group it runs on and is reused across syncs; `close` frees what it holds.

    Rounds may overlap: the transport posts round k (`post_send` / `post_recv`) up to `window`
    rounds before it completes it (`wait_send` / `wait_recv`), in round order on every rank.
    A service that moves one round at a time implements only `send_round` / `recv_round`
    (window 1: post keeps the messages, wait moves them).
    """

    window = 1

    def start(self, plan: "Plan", sync_rank: int, *, sending: bool, dtype: torch.dtype,
              timeout_s: float | None, stats: "SyncStats",
              peers: Collection[int] | None = None) -> None:
        """peers: the only ranks this sync exchanges messages with through this service
        (None: every peer the plan names)."""
        self.plan, self.sync_rank, self.dtype, self.peers = plan, sync_rank, dtype, peers
        self.timeout_s, self.stats = timeout_s, stats
        self._pending: dict[int, list[Message]] = {}

    @abstractmethod
    def send_round(self, k: int, messages: list[Message]) -> None:
        """Send round k's messages; return once their source views may change again."""

    @abstractmethod
    def recv_round(self, k: int, messages: list[Message]) -> Iterator[int]:
        """Receive round k's messages into their views; yield each message's index as its
        bytes are in place."""

    def post_send(self, k: int, messages: list[Message]) -> None:
        """Start sending round k (its source views must not change until `wait_send(k)`)."""
        self._pending[k] = messages

    def wait_send(self, k: int) -> None:
        """Round k's sends are done."""
        self.send_round(k, self._pending.pop(k))

    def post_recv(self, k: int, messages: list[Message]) -> None:
        """Start receiving round k into its views."""
        self._pending[k] = messages

    def wait_recv(self, k: int) -> Iterator[int]:
        """Yield each of round k's messages' index as its bytes are in place."""
        yield from self.recv_round(k, self._pending.pop(k))

    def finish(self) -> None:
        """The sync is over (or failed): release what was counted as staging."""

    def close(self) -> None:
        """Free buffers and handles (the sync group is being torn down)."""

    def label(self, peer: int) -> str:
        return self.plan.label(peer)


class PostingCopyService(CopyService):
    """A service that implements `post_*` / `wait_*` itself (rounds overlap); moving one
    round at a time is posting it and waiting for it."""

    def send_round(self, k: int, messages: list[Message]) -> None:
        self.post_send(k, messages)
        self.wait_send(k)

    def recv_round(self, k: int, messages: list[Message]) -> Iterator[int]:
        self.post_recv(k, messages)
        yield from self.wait_recv(k)


def wait_work(work, what: str, timeout_s: float | None) -> None:
    """Wait for a process-group work item; failures and deadlines become a SyncError naming
    `what` (the round, the direction and the peer)."""
    start = time.perf_counter()
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # gloo/NCCL raise RuntimeError subclasses with terse text
        raise SyncError(f"weight sync failed at {what} after "
                        f"{time.perf_counter() - start:.1f} s: {err}") from err


def _post(op, buf: torch.Tensor, peer: int, tag: int, what: str):
    """`op([buf], peer, tag)`: a send or receive posted on a group. A peer that is already gone
    fails the post itself (gloo: "Connection closed by peer"), before there is work to wait
    for: a SyncError naming `what`, as `wait_work` gives when it fails later."""
    try:
        return op([buf], peer, tag)
    except Exception as err:  # noqa: BLE001 — gloo/NCCL raise RuntimeError subclasses
        raise SyncError(f"weight sync failed at {what} (posting it): {err}") from err


class P2PCopy(PostingCopyService):
    """Messages as point-to-point sends on `group`, two rounds in flight.

    Framing: every transfer of a message is a segment of its own on the wire, tag =
    round · 4096 + its index in the message (both sides know it from the plan). A segment
    whose view is contiguous, of the wire dtype and on the wire's device goes out / lands as
    is — zero copy; any other is packed into / received into staging. Why not one packed
    buffer per (peer, round): on this project's CPU machines a copy of the bytes costs as much
    as moving them over loopback gloo, and a packed message costs two (pack, unpack), while a
    segment costs tens of µs; layouts make most transfers contiguous on both sides (every one
    for TP2·PP2 → TP2).

    Pipelining: round k + 1 is posted before round k is waited for (window 2), so the wire
    never idles between rounds. Staging: one persistent buffer per round in flight, reused
    across syncs, each at most the round's staged bytes ≤ one bucket: ≤ 2 buckets per rank.

    wire_device: where the group's bytes must live — "cpu" for gloo (its send/recv read raw
    host pointers, so CUDA tensors are bounced through a host buffer, as megatron's gloo copy
    service does); None for NCCL: the views' own device.
    """

    window = 2
    _SEGMENTS = 4096  # segments per message a round's tag range holds

    def __init__(self, group: dist.ProcessGroup, *, wire_device: str | None = None):
        self.group = group
        # a group that queues its ops (nccl_group.NcclP2PGroup) issues each round's as one
        # NCCL group launch; gloo's ops go out as they are posted
        self._launch = getattr(group, "launch_round", None)
        self.wire_device = None if wire_device is None else torch.device(wire_device)
        self._slots: list[torch.Tensor | None] = [None] * self.window

    def start(self, plan, sync_rank, *, sending, dtype, timeout_s, stats, peers=None) -> None:
        super().start(plan, sync_rank, sending=sending, dtype=dtype, timeout_s=timeout_s,
                      stats=stats, peers=peers)
        self._posted: dict[int, list] = {}
        self._held = [0] * self.window

    def _on_wire(self, view: torch.Tensor) -> bool:
        return self.wire_device is None or view.device == self.wire_device

    def _wire(self, view: torch.Tensor) -> torch.device:
        return view.device if self.wire_device is None else self.wire_device

    def _tag(self, k: int, j: int, peer: int) -> int:
        if j >= self._SEGMENTS:
            raise SyncError(f"round {k}: a message to/from {self.label(peer)} has more than "
                            f"{self._SEGMENTS} transfers (raise P2PCopy._SEGMENTS)")
        return k * self._SEGMENTS + j

    def _direct_send(self, view: torch.Tensor) -> bool:
        return view.is_contiguous() and view.dtype == self.dtype and self._on_wire(view)

    def _direct_recv(self, view: torch.Tensor) -> bool:
        return view.is_contiguous() and self._on_wire(view)

    def _staging(self, k: int, views: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Round k's staging (slot k mod window): a flat buffer of the wire dtype that holds
        `views`, kept across rounds and syncs and grown when a round needs more."""
        need = sum(v.numel() for v in views)
        if not need:
            return None
        i = k % self.window
        slot = self._slots[i]
        device = self._wire(views[0])
        if slot is None or slot.numel() < need or slot.device != device or \
                slot.dtype != self.dtype:
            slot = self._slots[i] = empty_host((need,), self.dtype, device=device)
        nbytes = slot.numel() * slot.element_size()
        if self._held[i] != nbytes:  # counted once per sync while in use
            self.stats.release(self._held[i])
            self.stats.hold(nbytes)
            self._held[i] = nbytes
        return slot

    def _pieces(self, k: int, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Round k's staging cut into one region per view, in order."""
        slot = self._staging(k, views)
        if slot is None:
            return []
        return list(slot[:sum(v.numel() for v in views)].split([v.numel() for v in views]))

    def post_send(self, k: int, messages: list[Message]) -> None:
        staged = [v for _, views in messages for v in views if not self._direct_send(v)]
        pieces = self._pieces(k, staged)
        if staged:  # every staged view in one vectorized copy (casts on the way)
            torch._foreach_copy_([p.view(v.shape) for p, v in zip(pieces, staged)], staged)
        pieces.reverse()
        posted = []
        for dst, views in messages:
            for j, view in enumerate(views):
                direct = self._direct_send(view)
                buf = view.detach() if direct else pieces.pop()
                posted.append((dst, _post(self.group.send, buf, dst, self._tag(k, j, dst),
                                          f"round {k}: send to {self.label(dst)}")))
                self.stats.zero_copy_messages += direct
                self.stats.messages += 1
                self.stats.bytes_sent += buf.numel() * buf.element_size()
        self._posted[k] = posted
        if self._launch is not None:
            self._launch()

    def wait_send(self, k: int) -> None:
        for dst, work in self._posted.pop(k):
            wait_work(work, f"round {k}: send to {self.label(dst)}", self.timeout_s)

    def post_recv(self, k: int, messages: list[Message]) -> None:
        staged = [v for _, views in messages for v in views if not self._direct_recv(v)]
        pieces = self._pieces(k, staged)
        pieces.reverse()
        posted = []
        for src, views in messages:
            segments = []
            for j, view in enumerate(views):
                direct = self._direct_recv(view)
                buf = view if direct else pieces.pop()
                segments.append((_post(self.group.recv, buf, src, self._tag(k, j, src),
                                       f"round {k}: receive from {self.label(src)}"), buf,
                                 None if direct else view))
                self.stats.zero_copy_messages += direct
                self.stats.messages += 1
            posted.append((src, segments))
        self._posted[k] = posted
        if self._launch is not None:
            self._launch()

    def wait_recv(self, k: int) -> Iterator[int]:
        for i, (src, segments) in enumerate(self._posted.pop(k)):
            for work, buf, view in segments:
                wait_work(work, f"round {k}: receive from {self.label(src)}", self.timeout_s)
                self.stats.bytes_received += buf.numel() * buf.element_size()
            staged = [(buf, view) for _, buf, view in segments if view is not None]
            if staged:
                torch._foreach_copy_([v for _, v in staged],
                                     [b.view(v.shape) for b, v in staged])
            yield i

    def finish(self) -> None:
        """Release the staging counted in this sync (the buffers stay for the next one); work
        still posted after a failure is dropped with the group it ran on."""
        for i, nbytes in enumerate(getattr(self, "_held", ())):
            self.stats.release(nbytes)
            self._held[i] = 0
        self._posted = {}

    def close(self) -> None:
        self._slots = [None] * self.window

    # single-view choices, kept for callers that ask which buffer a view would use
    def _pack(self, views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
        if len(views) == 1 and self._direct_send(views[0]):
            return views[0].detach(), 0
        buf = torch.empty(sum(v.numel() for v in views), dtype=self.dtype,
                          device=self._wire(views[0]))
        torch._foreach_copy_(list(buf.split([v.numel() for v in views])),
                             [v.reshape(-1) for v in views])
        return buf, buf.numel() * buf.element_size()

    def _recv_buffer(self, views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
        if len(views) == 1 and self._direct_recv(views[0]):
            return views[0], 0
        buf = torch.empty(sum(v.numel() for v in views), dtype=self.dtype,
                          device=self._wire(views[0]))
        return buf, buf.numel() * buf.element_size()


__all__ = ["CopyService", "Message", "P2PCopy", "PostingCopyService", "SyncError", "wait_work"]
