"""A rank whose peers use two transports: each message through its peer's copy service.

A colocated engine on a multi-node run gets the regions its own node holds through CUDA IPC and
the rest over the network (an IPC handle cannot be opened on another node), so one rank may
exchange messages by IPC with some peers and point-to-point with others in the same round.
`RoutedCopy` splits every round's messages by the peer's transport (`route`) and drives both
services round by round: posts go to both at once, and a round's wait does the IPC part first,
then the point-to-point part. Every point-to-point message of a round is posted before any
rank blocks on that round, and an IPC round blocks only on its peers' IPC part of the same
round, so no rank waits on one that is itself waiting on a later phase.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterator

from mcore_rl.resharding.copy_service import CopyService, Message, PostingCopyService
from mcore_rl.resharding.stats import SyncStats


def _plan_peers(plan, sync_rank: int, sending: bool) -> set[int]:
    mine = (lambda t: t.src_rank) if sending else (lambda t: t.dst_rank)
    theirs = (lambda t: t.dst_rank) if sending else (lambda t: t.src_rank)
    return {theirs(t) for rnd in plan.rounds for t in rnd if mine(t) == sync_rank}


class RoutedCopy(PostingCopyService):
    """services: copy service by transport name; route(peer): the peer's transport. Each
    service counts into its own `SyncStats` (`sub_stats[name]`), summed into the sync's at
    `finish`. The services belong to the caller (`SyncChannels`), which closes them."""

    ORDER = ("ipc", "p2p")  # a round's waits: IPC first (see the module docstring)

    def __init__(self, services: dict[str, CopyService], route: Callable[[int], str]):
        self.services = {n: services[n] for n in sorted(services, key=self._rank_of)}
        self.route = route
        self.window = min(s.window for s in self.services.values())

    @classmethod
    def _rank_of(cls, name: str) -> int:
        return cls.ORDER.index(name) if name in cls.ORDER else len(cls.ORDER)

    def start(self, plan, sync_rank, *, sending, dtype, timeout_s, stats,
              peers: Collection[int] | None = None) -> None:
        super().start(plan, sync_rank, sending=sending, dtype=dtype, timeout_s=timeout_s,
                      stats=stats, peers=peers)
        mine = _plan_peers(plan, sync_rank, sending)
        if peers is not None:
            mine &= set(peers)
        self.sub_stats = {name: SyncStats() for name in self.services}
        self._started = []
        for name, service in self.services.items():
            service.start(plan, sync_rank, sending=sending, dtype=dtype, timeout_s=timeout_s,
                          stats=self.sub_stats[name],
                          peers={p for p in mine if self.route(p) == name})
            self._started.append(service)
        self._indices: dict[int, dict[str, list[int]]] = {}

    def _split(self, k: int, messages: list[Message]) -> dict[str, list[Message]]:
        parts: dict[str, list[Message]] = {name: [] for name in self.services}
        indices: dict[str, list[int]] = {name: [] for name in self.services}
        for i, message in enumerate(messages):
            name = self.route(message[0])
            parts[name].append(message)
            indices[name].append(i)
        self._indices[k] = indices
        return parts

    def post_send(self, k: int, messages: list[Message]) -> None:
        for name, part in self._split(k, messages).items():
            self.services[name].post_send(k, part)

    def wait_send(self, k: int) -> None:
        self._indices.pop(k)
        for service in self.services.values():
            service.wait_send(k)

    def post_recv(self, k: int, messages: list[Message]) -> None:
        for name, part in self._split(k, messages).items():
            self.services[name].post_recv(k, part)

    def wait_recv(self, k: int) -> Iterator[int]:
        indices = self._indices.pop(k)
        for name, service in self.services.items():
            for i in service.wait_recv(k):
                yield indices[name][i]

    def finish(self) -> None:
        for service in getattr(self, "_started", ()):
            service.finish()
        for sub in getattr(self, "sub_stats", {}).values():
            for name in ("bytes_sent", "bytes_received", "messages", "zero_copy_messages",
                         "peak_extra_bytes"):  # both services' staging may coexist: a sum
                setattr(self.stats, name, getattr(self.stats, name) + getattr(sub, name))
        self._started = []


__all__ = ["RoutedCopy"]
