"""The IPC copy service: the refit path of colocated engines (an engine TP rank on the same
device as training ranks), where NCCL cannot carry the bytes (it refuses two ranks of one group
on one device) and a socket round trip would be waste.

Each training rank owns one staging buffer of one bucket (`shared_staging.SharedStaging`:
shared memory on CPU, a CUDA-IPC-shared tensor on GPU), created once per sync group and reused.
Per sync, before round 0, it hands the buffer's handle to the inference ranks it serves (they
map it once and cache it) and, once all of them have mapped it, unlinks the shared-memory file:
the mappings keep the bytes, and nothing is left behind even if a process is killed.
Per round k:
  sender:   write round k's messages into its buffer at their planned offsets; signal "ready";
            wait for every receiver of the round to signal "done" (the buffer is then free).
  receiver: wait for "ready" from each source of the round; copy straight from the source's
            buffer into its destination tensors; signal "done"; yield the message.
Signals and handles go over a gloo group (the control path; `SyncChannels.control`), so the
bulk bytes never touch a process group. Offsets come from the plan (`staging_layout`): every
rank computes the same layout, the plan fingerprints having been compared first.

Staging: one buffer of `max bytes this rank sends in a round` ≤ one bucket per training rank;
receivers need none (they copy out of the sender's buffer into their own shards).
"""

from __future__ import annotations

import json
from typing import Iterator

import torch
import torch.distributed as dist

from mcore_rl.resharding.copy_service import CopyService, Message, SyncError, wait_work
from mcore_rl.resharding.planner import Plan
from mcore_rl.resharding.shared_staging import HandleCache, SharedStaging, settle

_HANDLE_LEN, _HANDLE, _MAPPED = 0, 1, 2  # gloo tags of the handshake; rounds use 3 + 2k (+1)


def staging_layout(plan: Plan) -> tuple[dict[tuple[int, int, int], int], dict[int, int]]:
    """Byte offset of every message in its sender's staging buffer — (round, src, dst) →
    offset, in plan order — and each sender's buffer size (its largest round)."""
    offsets: dict[tuple[int, int, int], int] = {}
    need: dict[int, int] = {}
    for k in range(len(plan.rounds)):
        used: dict[int, int] = {}
        for (src, dst), transfers in plan.messages(k).items():
            offsets[(k, src, dst)] = used.get(src, 0)
            used[src] = used.get(src, 0) + sum(t.numel for t in transfers) * plan.element_size
        for src, nbytes in used.items():
            need[src] = max(need.get(src, 0), nbytes)
    return offsets, need


def _peers(plan: Plan, sync_rank: int, sending: bool) -> list[int]:
    """The ranks this rank exchanges messages with in any round of the plan, sorted."""
    out = set()
    for rnd in plan.rounds:
        for t in rnd:
            if sending and t.src_rank == sync_rank:
                out.add(t.dst_rank)
            elif not sending and t.dst_rank == sync_rank:
                out.add(t.src_rank)
    return sorted(out)


class IpcCopy(CopyService):
    """Messages through shared staging buffers; `control` (gloo) carries handles and signals.
    device: this rank's device from the resolved run (where its staging buffer lives, or where
    it maps its peers' buffers)."""

    def __init__(self, control: dist.ProcessGroup, device: str | torch.device = "cpu"):
        self.control = control
        self.device = torch.device(device)
        self._staging: SharedStaging | None = None
        self._mapped = HandleCache(self.device)
        self._held = 0
        # the plan's staging layout: one pass over every transfer, done again only when the
        # plan changes (a sync group reuses its plan from sync to sync)
        self._layout: tuple[Plan, tuple] | None = None

    # ---------------------------------------------------------------- per sync

    def start(self, plan, sync_rank, *, sending, dtype, timeout_s, stats, peers=None) -> None:
        super().start(plan, sync_rank, sending=sending, dtype=dtype, timeout_s=timeout_s,
                      stats=stats, peers=peers)
        if self._layout is None or self._layout[0] is not plan:
            self._layout = (plan, staging_layout(plan))
        self._offsets, need = self._layout[1]
        peers = [p for p in _peers(plan, sync_rank, sending) if peers is None or p in peers]
        if sending:
            size = need.get(sync_rank, 0)
            if self._staging is None or self._staging.nbytes < size:
                self.close()
                self._staging = SharedStaging(size, self.device, sync_rank)
            self._held = self._staging.nbytes
            stats.hold(self._held)
            self._hand_out(peers)
        else:
            self._buffers = {src: self._map(src) for src in peers}

    def _hand_out(self, receivers: list[int]) -> None:
        """Send this rank's handle to every receiver; once all have mapped it, the
        shared-memory file can go (their mappings keep the bytes)."""
        raw = torch.frombuffer(bytearray(self._staging.handle()), dtype=torch.uint8)
        size = torch.tensor([raw.numel()], dtype=torch.int64)
        works = [(dst, self.control.send([size], dst, _HANDLE_LEN),
                  self.control.send([raw], dst, _HANDLE)) for dst in receivers]
        acks = {dst: torch.zeros(1, dtype=torch.int64) for dst in receivers}
        for dst, *sends in works:
            for work in sends:
                wait_work(work, f"staging handle to {self.label(dst)}", self.timeout_s)
        for dst, ack in acks.items():
            wait_work(self.control.recv([ack], dst, _MAPPED),
                      f"staging handle to {self.label(dst)} (mapping it)", self.timeout_s)
            if ack.item() != 1:
                raise SyncError(f"{self.label(dst)} could not map the staging buffer of "
                                f"{self.label(self.sync_rank)}")
        self._staging.unlink()

    def _map(self, src: int) -> torch.Tensor:
        what = f"staging handle from {self.label(src)}"
        size = torch.zeros(1, dtype=torch.int64)
        wait_work(self.control.recv([size], src, _HANDLE_LEN), what, self.timeout_s)
        raw = torch.empty(int(size.item()), dtype=torch.uint8)
        wait_work(self.control.recv([raw], src, _HANDLE), what, self.timeout_s)
        ok, err = 1, None
        try:
            buffer = self._mapped.get(src, raw.numpy().tobytes())
        except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
            ok, err, buffer = 0, exc, None
        wait_work(self.control.send([torch.tensor([ok], dtype=torch.int64)], src, _MAPPED),
                  what, self.timeout_s)
        if err is not None:
            raise SyncError(f"{self.label(self.sync_rank)} could not map the staging buffer of "
                            f"{self.label(src)}: {err}") from err
        return buffer

    def finish(self) -> None:
        self.stats.release(self._held)
        self._held = 0

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        self._mapped.clear()

    # ---------------------------------------------------------------- per round

    def send_round(self, k: int, messages: list[Message]) -> None:
        esize = self.plan.element_size
        for dst, views in messages:
            offset = self._offsets[(k, self.sync_rank, dst)]
            for view in views:
                n = view.numel() * esize
                self._staging.tensor[offset:offset + n].view(self.dtype).view(view.shape) \
                    .copy_(view)
                offset += n
            self.stats.messages += 1
            self.stats.bytes_sent += sum(v.numel() for v in views) * esize
        settle(self.device)  # the bytes are in place before "ready" can be seen
        ready = [self.control.send([torch.tensor([k], dtype=torch.int64)], dst, 3 + 2 * k)
                 for dst, _ in messages]
        done = [(dst, torch.full((1,), -1, dtype=torch.int64)) for dst, _ in messages]
        done_works = [self.control.recv([flag], dst, 4 + 2 * k) for dst, flag in done]
        for (dst, _), work in zip(messages, ready):
            wait_work(work, f"round {k}: send to {self.label(dst)}", self.timeout_s)
        for (dst, flag), work in zip(done, done_works):
            wait_work(work, f"round {k}: send to {self.label(dst)} (waiting for it to copy)",
                      self.timeout_s)
            if flag.item() != k:
                raise SyncError(f"round {k}: {self.label(dst)} signalled round {flag.item()}")

    def recv_round(self, k: int, messages: list[Message]) -> Iterator[int]:
        esize = self.plan.element_size
        flags = [torch.full((1,), -1, dtype=torch.int64) for _ in messages]
        ready = [self.control.recv([flag], src, 3 + 2 * k)
                 for (src, _), flag in zip(messages, flags)]
        sent = []
        for i, ((src, views), flag, work) in enumerate(zip(messages, flags, ready)):
            wait_work(work, f"round {k}: receive from {self.label(src)}", self.timeout_s)
            if flag.item() != k:
                raise SyncError(f"round {k}: {self.label(src)} signalled round {flag.item()}")
            buffer, offset = self._buffers[src], self._offsets[(k, src, self.sync_rank)]
            for view in views:
                n = view.numel() * esize
                view.copy_(buffer[offset:offset + n].view(self.dtype).view(view.shape))
                offset += n
            self.stats.messages += 1
            self.stats.bytes_received += sum(v.numel() for v in views) * esize
            settle(self.device)  # copied out before the sender may overwrite
            sent.append((src, self.control.send([torch.tensor([k], dtype=torch.int64)], src,
                                                4 + 2 * k)))
            yield i
        for src, work in sent:
            wait_work(work, f"round {k}: receive from {self.label(src)} (signalling done)",
                      self.timeout_s)


__all__ = ["IpcCopy", "staging_layout"]
