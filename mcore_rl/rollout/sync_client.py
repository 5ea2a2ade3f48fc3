"""The engine side of the shard-to-shard weight sync, driven through vLLM's weight-transfer API
(`LLM.init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`, `shutdown_weight_transfer_engine`); weight_transfer.py is the backend
those calls reach in every worker.

The trainer hosts the sync group's store; `start_join_sync_group` / `finish_join_sync_group`
bracket the trainer's own join; `begin_sync(plan)` starts the update in a thread and returns
at once (the workers' receives block until the trainer's sends arrive, so the two must
overlap); `finish_sync()` waits for it, checks each rank installed exactly the plan's names,
and resets the prefix cache. vLLM's calls return nothing and the backend never raises (see
weight_transfer.py), so each outcome is read back per rank (`weight_transfer_outcome`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from mcore_rl.rollout.errors import RolloutError
from mcore_rl.rollout.lora import target_modules


@dataclass
class RankSync:
    """What one worker did in a sync: names installed, bytes received (of them, received
    straight into the parameters they replace), seconds spent (in all; installing; digesting
    what it installed; comparing digests with the group's)."""

    rank: int
    sync_rank: int
    names: list[str]
    bytes_received: int
    peak_extra_bytes: int
    seconds: float
    install_seconds: float
    digest_seconds: float = 0.0
    compare_seconds: float = 0.0
    bytes_in_place: int = 0


@dataclass
class SyncReport:
    engine: int
    ranks: list[RankSync] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "seconds": self.seconds,
                "ranks": [{k: v for k, v in r.__dict__.items() if k != "names"}
                          | {"tensors": len(r.names)} for r in self.ranks]}


class _Background:
    """A blocking vLLM call in a daemon thread, waited for with a deadline."""

    def __init__(self, name: str, work: Callable[[], None]):
        self.error: str | None = None
        self.started = time.perf_counter()

        def run() -> None:
            try:
                work()
            except BaseException as err:  # noqa: BLE001 — reported by the waiter
                self.error = f"{type(err).__name__}: {err}"

        self.thread = threading.Thread(target=run, daemon=True, name=name)
        self.thread.start()

    def finished(self, timeout_s: float) -> bool:
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


class EngineSync:
    """The weight-sync methods of `RolloutEngine` (mixed into it). Uses the engine's `llm`,
    `index`, `cfg`, `lora`, `adapter_installed`, `call_timeout_s`, `_check_replies`,
    `_check_idle` and `reset_prefix_cache`."""

    def start_join_sync_group(self, spec, first_sync_rank: int,
                              devices: tuple[str, ...] | None = None,
                              expected: Sequence[Mapping[str, Sequence[int]]] | None = None
                              ) -> None:
        """Every worker starts joining the sync group `spec` (a `SyncGroupSpec`) as sync rank
        `first_sync_rank + tp_rank`; returns at once. The trainer then joins (rank 0 blocks
        until everyone is in) and calls `finish_join_sync_group`.
        devices: per TP rank, its device (the resolved run's `engine_devices[e]`), which each
        worker checks against the device vLLM gave it. expected: per TP rank, what the sync
        plan writes there (`plan.written(first_sync_rank + r)`): each worker checks, once
        joined, that this is exactly its parameters — `finish_join_sync_group` then names any
        it never writes (they would keep stale weights, garbage after a level-2 wake)."""
        self._check_idle("sync")
        if self._join is not None:
            raise RolloutError(self.index, "sync", "already joining a sync group")
        init = {"spec": spec, "first_sync_rank": first_sync_rank,
                "devices": None if devices is None else tuple(devices),
                "expected": None if expected is None else
                tuple({name: tuple(shape) for name, shape in rank.items()}
                      for rank in expected)}
        self._join = _Background(f"mcore-rl-join-engine{self.index}",
                                 lambda: self.llm.init_weight_transfer_engine(
                                     {"init_info": init}))
        self._first_sync_rank = first_sync_rank

    def finish_join_sync_group(self, timeout_s: float | None = None) -> None:
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        join, self._join = self._join, None
        if join is None:
            raise RolloutError(self.index, "sync", "finish_join_sync_group without "
                                                   "start_join_sync_group")
        if not join.finished(timeout):
            raise RolloutError(self.index, "sync", f"still joining the sync group after "
                                                   f"{timeout:.0f} s")
        if join.error is not None:
            raise RolloutError(self.index, "sync", f"init_weight_transfer_engine failed: "
                                                   f"{join.error}")
        self._outcomes("init", "init_weight_transfer_engine")

    def leave_sync_group(self) -> None:
        """The workers leave the sync group (after a failed sync: it is formed anew with a new
        prefix)."""
        self._check_idle("sync")
        leave = _Background(f"mcore-rl-leave-engine{self.index}",
                            self.llm.shutdown_weight_transfer_engine)
        if not leave.finished(self.call_timeout_s):
            raise RolloutError(self.index, "sync", f"shutdown_weight_transfer_engine still "
                                                   f"running after {self.call_timeout_s:.0f} s")
        if leave.error is not None:
            raise RolloutError(self.index, "sync", f"shutdown_weight_transfer_engine failed: "
                                                   f"{leave.error}")
        self._first_sync_rank = None

    def begin_sync(self, plan, *, dtype: torch.dtype = torch.float32, verify: bool = True,
                   timeout_s: float | None = None, adapter: bool = False,
                   corrupt: tuple[int, str] | None = None) -> None:
        """Start the workers' receive-and-install of their shards in a thread and return at
        once; the trainer's sends must run while it is in flight.
        verify: workers take part in `verify_plan` (the trainer ranks must call it too).
        adapter: the plan carries the policy's LoRA adapter (whole PEFT tensors on every
        worker), which replaces the engine's; generations apply it from then on.
        corrupt: fault injection for tests, `(sync rank, vLLM name)` (`ShardUpdateInfo`)."""
        self._check_idle("sync")
        if self._first_sync_rank is None:
            raise RolloutError(self.index, "sync", "begin_sync before start_join_sync_group")
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        # the workers get what came (the plan, or its reference: they keep plans too)
        sent, self._sync_plan = plan, self._plans.resolve(plan)
        update = {"plan": sent, "dtype": str(dtype).removeprefix("torch."),
                  "timeout_s": timeout, "verify": verify, "corrupt": corrupt,
                  "adapter": self._adapter_config(
                      self._sync_plan.expected_names(self._first_sync_rank)) if adapter else None}
        self._sync_adapter = adapter
        self._sync_timeout = timeout
        self._sync_thread = _Background(f"mcore-rl-sync-engine{self.index}",
                                        lambda: self._update(update))

    def _update(self, update_info: dict[str, Any]) -> None:
        """One weight update through vLLM's API (every worker's backend never raises). When
        `update_weights` raises all the same (a request vLLM cannot send to its workers, an
        executor that failed), the workers' update sessions are ended before the error goes
        on: vLLM would otherwise keep each worker's update flag set, and refuse the next
        `start_weight_update` and `shutdown_weight_transfer_engine`."""
        self.llm.start_weight_update()
        try:
            self.llm.update_weights({"update_info": update_info})
        except BaseException:
            self._end_update_sessions()
            raise
        self.llm.finish_weight_update()

    def _end_update_sessions(self) -> None:
        """End the update session of every worker that still has one (`end_weight_update`:
        a worker whose own update raised has ended it already — vLLM's finish would raise
        there, and a raising worker leaves its peers' replies queued)."""
        try:
            self.llm.collective_rpc("end_weight_update", timeout=self.call_timeout_s)
        except Exception:  # noqa: BLE001 — an executor that failed cannot be cleaned up
            pass

    def finish_sync(self, timeout_s: float | None = None) -> SyncReport:
        """Wait for `begin_sync`'s update; check that each rank installed exactly the plan's
        names for its sync rank; reset the prefix cache. Raises RolloutError naming the engine,
        the rank and the missing / unexpected names."""
        sync = self._sync_thread
        if sync is None:
            raise RolloutError(self.index, "sync", "finish_sync without begin_sync")
        timeout = self._sync_timeout + 20.0 if timeout_s is None else timeout_s
        if not sync.finished(timeout):
            raise RolloutError(self.index, "sync", f"update_weights still running after "
                                                   f"{timeout:.0f} s (engine is stuck)")
        plan, self._sync_thread = self._sync_plan, None
        if sync.error is not None:
            raise RolloutError(self.index, "sync", f"weight update failed: {sync.error}")
        replies = self._outcomes("update", "update_weights")
        report = SyncReport(self.index)
        for rank, reply in enumerate(replies):
            expected = plan.expected_names(reply["sync_rank"])
            got = set(reply["names"])
            if got != expected:
                raise RolloutError(self.index, "sync", _names_problem(expected, got), rank=rank)
            report.ranks.append(RankSync(
                rank, reply["sync_rank"], reply["names"], reply["bytes_received"],
                reply["peak_extra_bytes"], reply["seconds"], reply["install_seconds"],
                reply["digest_seconds"], reply["compare_seconds"], reply["bytes_in_place"]))
        self._reinstall_adapter(self._sync_adapter)
        self.reset_prefix_cache()
        report.seconds = time.perf_counter() - sync.started
        return report

    def install_tensors(self, items: Iterable[tuple[str, torch.Tensor]], *,
                        adapter: bool = False) -> list[str]:
        """Install full per-rank tensors passed in the call itself, then reset the prefix
        cache. TP=1 only (the one rank's shard is the whole model): with TP > 1 every rank
        must receive only its own shard, through `begin_sync` / `finish_sync`.
        adapter: the tensors are the policy's LoRA adapter (PEFT names), as in `begin_sync`."""
        if self.cfg.tp != 1:
            raise RolloutError(self.index, "sync", "install_tensors is for tp=1; use "
                                                   "begin_sync/finish_sync with tp > 1")
        self._check_idle("sync")
        items = list(items)
        update = {"tensors": items,
                  "adapter": self._adapter_config([n for n, _ in items]) if adapter else None}
        try:
            self._update(update)
        except Exception as err:
            raise RolloutError(self.index, "sync", f"weight update failed: "
                                                   f"{type(err).__name__}: {err}") from err
        reply, = self._outcomes("update", "update_weights")
        self._reinstall_adapter(adapter)
        self.reset_prefix_cache()
        return reply["names"]

    def _reinstall_adapter(self, arrived: bool) -> None:
        """After a weight update vLLM holds no adapter: the workers install the one they last
        received (`arrived`: this update brought it)."""
        if not (arrived or self.adapter_installed):
            return
        self.call_workers("install_policy_adapter", phase="sync")
        self.adapter_installed = True

    def _adapter_config(self, names: Iterable[str]) -> dict[str, Any]:
        """The PEFT config the workers build the adapter `names` with."""
        if self.lora is None:
            raise RolloutError(self.index, "sync", "an adapter sync, but this engine serves no "
                                                   "LoRA adapters (started without lora)")
        return self.lora.peft_config(target_modules(list(names)))

    def _outcomes(self, call: str, api: str) -> list[dict[str, Any]]:
        """Every worker's outcome of the backend's last `call`, checked: a failed rank raises
        RolloutError naming it and `api`, the vLLM call that failed."""
        try:
            replies = self.llm.collective_rpc("weight_transfer_outcome",
                                              timeout=self.call_timeout_s, args=(call,))
        except Exception as err:
            raise RolloutError(self.index, "sync", f"weight_transfer_outcome RPC failed: "
                                                   f"{type(err).__name__}: {err}") from err
        return self._check_replies(api, "sync", replies)


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
