"""One rank's share of a plan, compiled once: per round, the peers it exchanges messages with
and, per message, the (tensor key, slices) of each transfer in plan order.

Walking the whole plan (every rank's transfers) and turning boxes into slices is per-sync
Python work that grows with the model and the world; a rank needs only its own rows, and they
never change for one plan. `SyncChannels` keeps compiled schedules keyed by the plan's
fingerprint (which every rank compares with its peers before any byte moves), so each rank
compiles its schedule on the first sync of a plan and reuses it on every later one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from mcore_rl.layouts.layout import Box, box_slices
from mcore_rl.resharding.planner import Plan

# one transfer of a message: (this rank's tensor key, the slices of it, elements)
Item = tuple[str, tuple[slice, ...], int]


@dataclass(frozen=True)
class RankSchedule:
    """rounds[k]: [(peer, [Item, ...])] in plan order. Receive side only: `shapes` (what this
    rank assembles) and `covered` (elements it receives per key; fewer than the shape holds
    means padding that must stay zero). Send side only: `targets`, shaped as `rounds`, the
    (destination key, destination box) of each item — what the sent digests describe."""

    sync_rank: int
    sending: bool
    rounds: tuple[tuple[tuple[int, tuple[Item, ...]], ...], ...]
    shapes: dict[str, tuple[int, ...]]
    covered: dict[str, int]
    targets: tuple[tuple[tuple[tuple[str, Box], ...], ...], ...] = ()


def compile_schedule(plan: Plan, sync_rank: int, *, sending: bool,
                     peers: Collection[int] | None = None) -> RankSchedule:
    """This rank's rows of `plan` (only messages with `peers`, if given)."""
    rounds, targets = [], []
    covered: dict[str, int] = {}
    for rnd in plan.rounds:
        messages: dict[int, list[Item]] = {}
        dests: dict[int, list[tuple[str, Box]]] = {}
        for t in rnd:
            mine = t.src_rank if sending else t.dst_rank
            peer = t.dst_rank if sending else t.src_rank
            if mine != sync_rank or (peers is not None and peer not in peers):
                continue
            key, box = (t.src_key, t.src_box) if sending else (t.dst_key, t.dst_box)
            messages.setdefault(peer, []).append((key, box_slices(box), t.numel))
            if sending:
                dests.setdefault(peer, []).append((t.dst_key, t.dst_box))
            else:
                covered[key] = covered.get(key, 0) + t.numel
        rounds.append(tuple((peer, tuple(items)) for peer, items in messages.items()))
        targets.append(tuple(tuple(dests[peer]) for peer in messages) if sending else ())
    shapes = {} if sending else dict(plan.dst_shapes.get(sync_rank, {}))
    return RankSchedule(sync_rank, sending, tuple(rounds), shapes, covered,
                        tuple(targets) if sending else ())


class ScheduleCache:
    """Compiled schedules of one rank, by (plan fingerprint, direction, peers); a few plans
    at most (a run has one; a resized engine set gives a new one)."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._entries: dict[tuple, RankSchedule] = {}

    def get(self, plan: Plan, sync_rank: int, *, sending: bool,
            peers: Collection[int] | None = None) -> RankSchedule:
        key = (plan.fingerprint(), sync_rank, sending,
               None if peers is None else frozenset(peers))
        if key not in self._entries:
            if len(self._entries) >= self.capacity:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = compile_schedule(plan, sync_rank, sending=sending,
                                                  peers=peers)
        return self._entries[key]


__all__ = ["Item", "RankSchedule", "ScheduleCache", "compile_schedule"]
