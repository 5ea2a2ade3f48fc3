"""The engine side of the shard-to-shard weight sync: the RPCs that drive an engine's workers
(worker_extension.py) through joining the sync group and receiving and installing a plan.

The trainer hosts the sync group's store; `start_join_sync_group` / `finish_join_sync_group`
bracket the trainer's own join; `begin_sync(plan)` starts the workers' receive-and-install RPC
in a thread and returns at once (the RPC blocks until the trainer's sends arrive, so the two
must overlap); `finish_sync()` waits for it, checks each rank installed exactly the plan's
names, and resets the prefix cache.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from mcore_rl.rollout.errors import RolloutError


@dataclass
class RankSync:
    """What one worker did in a sync: names installed, bytes received, seconds spent."""

    rank: int
    sync_rank: int
    names: list[str]
    bytes_received: int
    peak_extra_bytes: int
    seconds: float
    install_seconds: float


@dataclass
class SyncReport:
    engine: int
    ranks: list[RankSync] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "seconds": self.seconds,
                "ranks": [{k: v for k, v in r.__dict__.items() if k != "names"}
                          | {"tensors": len(r.names)} for r in self.ranks]}


class EngineSync:
    """The weight-sync methods of `RolloutEngine` (mixed into it). Uses the engine's `llm`,
    `index`, `cfg`, `call_timeout_s`, `call_workers`, `_check_replies`, `_check_idle` and
    `reset_prefix_cache`."""

    def start_join_sync_group(self, spec, first_sync_rank: int,
                              devices: tuple[str, ...] | None = None) -> None:
        """Every worker starts joining the sync group `spec` (a `SyncGroupSpec`) as sync rank
        `first_sync_rank + tp_rank` in a background thread; returns at once. The trainer then
        joins (rank 0 blocks until everyone is in) and calls `finish_join_sync_group`.
        devices: per TP rank, its device (the resolved run's `engine_devices[e]`)."""
        self.call_workers("start_join_sync_group", spec, first_sync_rank, devices,
                          phase="sync")
        self._first_sync_rank = first_sync_rank

    def finish_join_sync_group(self, timeout_s: float | None = None) -> None:
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        self.call_workers("finish_join_sync_group", timeout, phase="sync",
                          timeout_s=timeout + 10.0)

    def leave_sync_group(self) -> None:
        """Shut the workers' sync-group handles down (after a failed sync: re-form the group
        with a new prefix)."""
        self.call_workers("leave_sync_group", phase="sync")
        self._first_sync_rank = None

    def begin_sync(self, plan, *, dtype: torch.dtype = torch.float32, verify: bool = True,
                   timeout_s: float | None = None) -> None:
        """Start every worker's receive-and-install of its shards (`install_shards`) in a
        thread and return at once; the trainer's sends must run while it is in flight.
        verify: workers take part in `verify_plan` (the trainer ranks must call it too)."""
        self._check_idle("sync")
        if self._first_sync_rank is None:
            raise RolloutError(self.index, "sync", "begin_sync before start_join_sync_group")
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        # the workers get what came (the plan, or its reference: they keep plans too)
        sent, plan = plan, self._plans.resolve(plan)
        result: dict[str, Any] = {}
        dtype_name = str(dtype).removeprefix("torch.")

        def run() -> None:
            try:
                result["replies"] = self.llm.collective_rpc(
                    "install_shards", timeout=timeout + 10.0,
                    args=(sent,), kwargs={"dtype": dtype_name, "timeout_s": timeout,
                                          "verify": verify})
            except BaseException as err:  # noqa: BLE001 — reported by finish_sync
                result["error"] = f"{type(err).__name__}: {err}"

        self._sync_plan, self._sync_result = plan, result
        self._sync_started = time.perf_counter()
        self._sync_timeout = timeout
        self._sync_thread = threading.Thread(target=run, daemon=True,
                                             name=f"mcore-rl-sync-engine{self.index}")
        self._sync_thread.start()

    def finish_sync(self, timeout_s: float | None = None) -> SyncReport:
        """Wait for `begin_sync`'s RPC; check that each rank installed exactly the plan's names
        for its sync rank; reset the prefix cache. Raises RolloutError naming the engine, the
        rank and the missing / unexpected names."""
        if self._sync_thread is None:
            raise RolloutError(self.index, "sync", "finish_sync without begin_sync")
        timeout = self._sync_timeout + 20.0 if timeout_s is None else timeout_s
        self._sync_thread.join(timeout)
        if self._sync_thread.is_alive():
            raise RolloutError(self.index, "sync", f"install_shards still running after "
                                                   f"{timeout:.0f} s (engine is stuck)")
        plan, result = self._sync_plan, self._sync_result
        self._sync_thread = None
        if "error" in result:
            raise RolloutError(self.index, "sync", f"install_shards RPC failed: "
                                                   f"{result['error']}")
        replies = self._check_replies("install_shards", "sync", result["replies"])
        report = SyncReport(self.index)
        for rank, reply in enumerate(replies):
            expected = plan.expected_names(reply["sync_rank"])
            got = set(reply["names"])
            if got != expected:
                raise RolloutError(self.index, "sync", _names_problem(expected, got), rank=rank)
            report.ranks.append(RankSync(
                rank, reply["sync_rank"], reply["names"], reply["bytes_received"],
                reply["peak_extra_bytes"], reply["seconds"], reply["install_seconds"]))
        self.reset_prefix_cache()
        report.seconds = time.perf_counter() - self._sync_started
        return report

    def install_tensors(self, items: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Install full per-rank tensors passed in the call itself, then reset the prefix
        cache. TP=1 only (the one rank's shard is the whole model): with TP > 1 every rank
        must receive only its own shard, through `begin_sync` / `finish_sync`."""
        if self.cfg.tp != 1:
            raise RolloutError(self.index, "sync", "install_tensors is for tp=1; use "
                                                   "begin_sync/finish_sync with tp > 1")
        self._check_idle("sync")
        reply, = self.call_workers("install_tensors", list(items), phase="sync")
        self.reset_prefix_cache()
        return reply["names"]


def _names_problem(expected: set[str], got: set[str]) -> str:
    missing, extra = sorted(expected - got), sorted(got - expected)
    parts = []
    if missing:
        parts.append(f"{len(missing)} expected tensors not installed: {missing[:5]}"
                     + (" ..." if len(missing) > 5 else ""))
    if extra:
        parts.append(f"{len(extra)} unexpected tensors installed: {extra[:5]}"
                     + (" ..." if len(extra) > 5 else ""))
    return "; ".join(parts)


__all__ = ["EngineSync", "RankSync", "SyncReport"]
