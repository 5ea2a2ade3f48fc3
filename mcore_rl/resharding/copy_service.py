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
from typing import TYPE_CHECKING, Collection, Iterator, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mcore_rl.resharding.planner import Plan
    from mcore_rl.resharding.transport import SyncStats

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
    """

    def start(self, plan: "Plan", sync_rank: int, *, sending: bool, dtype: torch.dtype,
              timeout_s: float | None, stats: "SyncStats",
              peers: Collection[int] | None = None) -> None:
        """peers: the only ranks this sync exchanges messages with through this service
        (None: every peer the plan names)."""
        self.plan, self.sync_rank, self.dtype, self.peers = plan, sync_rank, dtype, peers
        self.timeout_s, self.stats = timeout_s, stats

    @abstractmethod
    def send_round(self, k: int, messages: list[Message]) -> None:
        """Send round k's messages; return once their source views may change again."""

    @abstractmethod
    def recv_round(self, k: int, messages: list[Message]) -> Iterator[int]:
        """Receive round k's messages into their views; yield each message's index as its
        bytes are in place."""

    def finish(self) -> None:
        """The sync is over (or failed): release what was counted as staging."""

    def close(self) -> None:
        """Free buffers and handles (the sync group is being torn down)."""

    def label(self, peer: int) -> str:
        return self.plan.label(peer)


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


class P2PCopy(CopyService):
    """Messages as point-to-point sends on `group`, one per (peer, round), tag = round.

    wire_device: where the group's bytes must live — "cpu" for gloo (its send/recv read raw
    host pointers, so CUDA tensors are bounced through a host buffer, as megatron's gloo copy
    service does); None for NCCL: the views' own device. Staging buffers are created on the
    wire device, so CUDA parameters go zero-copy over NCCL.
    """

    def __init__(self, group: dist.ProcessGroup, *, wire_device: str | None = None):
        self.group = group
        self.wire_device = None if wire_device is None else torch.device(wire_device)

    def _on_wire(self, view: torch.Tensor) -> bool:
        return self.wire_device is None or view.device == self.wire_device

    def _wire(self, view: torch.Tensor) -> torch.device:
        return view.device if self.wire_device is None else self.wire_device

    def send_round(self, k: int, messages: list[Message]) -> None:
        posted = []
        for dst, views in messages:
            buf, staged = self._pack(views)
            self.stats.hold(staged)
            posted.append((dst, self.group.send([buf], dst, k), staged))
            self.stats.messages += 1
            self.stats.zero_copy_messages += staged == 0
            self.stats.bytes_sent += buf.numel() * buf.element_size()
        for dst, work, staged in posted:
            wait_work(work, f"round {k}: send to {self.label(dst)}", self.timeout_s)
            self.stats.release(staged)

    def _pack(self, views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
        first = views[0]
        if len(views) == 1 and first.is_contiguous() and first.dtype == self.dtype \
                and self._on_wire(first):
            return first.detach(), 0
        buf = torch.empty(sum(v.numel() for v in views), dtype=self.dtype,
                          device=self._wire(first))
        offset = 0
        for view in views:
            buf[offset:offset + view.numel()].view(view.shape).copy_(view)
            offset += view.numel()
        return buf, buf.numel() * buf.element_size()

    def recv_round(self, k: int, messages: list[Message]) -> Iterator[int]:
        posted = []
        for src, views in messages:
            buf, staged = self._recv_buffer(views)
            self.stats.hold(staged)
            posted.append((src, views, buf, staged, self.group.recv([buf], src, k)))
            self.stats.messages += 1
            self.stats.zero_copy_messages += staged == 0
        for i, (src, views, buf, staged, work) in enumerate(posted):
            wait_work(work, f"round {k}: receive from {self.label(src)}", self.timeout_s)
            self.stats.bytes_received += buf.numel() * buf.element_size()
            if staged:
                _unpack(buf, views)
            self.stats.release(staged)
            yield i

    def _recv_buffer(self, views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int]:
        first = views[0]
        if len(views) == 1 and first.is_contiguous() and self._on_wire(first):
            return first, 0
        buf = torch.empty(sum(v.numel() for v in views), dtype=self.dtype,
                          device=self._wire(first))
        return buf, buf.numel() * buf.element_size()


def _unpack(buf: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
    offset = 0
    for view in views:
        view.copy_(buf[offset:offset + view.numel()].view(view.shape))
        offset += view.numel()


__all__ = ["CopyService", "Message", "P2PCopy", "SyncError", "wait_work"]
