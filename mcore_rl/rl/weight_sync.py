"""The controller's weight sync: the sync group of actor ranks and engine ranks, the plan of
shard transfers between them, and the sync itself — the actor ranks stream their shards,
each engine rank receives only what it holds (mcore_rl/resharding). Timed as its own phase,
never billed to the actor.

`WeightSync` is a component of `RLController` (rl/controller.py), which wraps `sync_once`
with the rollout pipeline's pause and engine recovery (`RLController.sync_weights`).

LoRA with `actor.lora.sync: adapter`: once the actor carries its adapters, a sync streams
the adapters alone (`adapter_sync_plan`); the engines keep their base. The base goes too, once
per sync group, when it is not the one the engines loaded: after a warm-up trained it (or a
checkpoint of such a run), and before the adapters exist every sync is a full one.
"""

from __future__ import annotations

from mcore_rl.config.dtypes import torch_dtype
from mcore_rl.launch.watchdog import WatchdogTimeout
from mcore_rl.planning.sync_traffic import adapter_sync_plan, sync_plan
from mcore_rl.resharding import host_store, sync_group_spec
from mcore_rl.resharding.plan_cache import PlanSender
from mcore_rl.rl.actor_ranks import ActorRanks
from mcore_rl.rl.recovery import InjectedKills
from mcore_rl.runconfig import RLConfig


class SyncFailed(RuntimeError):
    """A weight sync failed; names the engines that died."""


def _last_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


class WeightSync:
    """The sync group, the plan and the sync (module doc). `actors`: the actor ranks that
    send; `engines`: the rollout engines that receive; `kills`: fault injection (tests)."""

    def __init__(self, cfg: RLConfig, *, spec, run, host: str, actors: ActorRanks, engines,
                 kills: InjectedKills):
        self.cfg, self.spec, self.run, self.host = cfg, spec, run, host
        self.actors, self.engines, self.kills = actors, engines, kills
        self.groups_formed = 0
        self._store = None
        lora = cfg.actor.lora
        self.adapter_sync = lora.syncs_adapters
        # the adapters exist from the start unless a warm-up trains the whole model first
        # (the controller's reset_optimizer attaches them then: `adapters_attached`)
        self.adapters_on = lora.enabled and cfg.warmup.max_steps == 0
        self._base_current = False  # the engines hold the actor's base (set per group)
        self._build_plan()
        self.join_group()

    def _build_plan(self) -> None:
        """Every shard transfer of a sync, from the actor's layout to the engines' (`plan`),
        and its sender (resharding/plan_cache.py: sent whole once per sync group)."""
        self.plan = sync_plan(self.cfg, self.run, self.spec, self.engines.num_engines)
        self._plan_sender = PlanSender(self.plan)
        self._adapter_sender = None
        if self.adapter_sync:
            self._adapter_sender = PlanSender(adapter_sync_plan(
                self.cfg, self.run, self.spec, self.engines.num_engines))

    def join_group(self) -> None:
        """Form the sync group (again after an engine restart: a new store and prefix)."""
        world = self.cfg.actor.world_size + self.cfg.rollout.tp * self.engines.num_engines
        self._store = host_store(self.host, world_size=world,
                                 timeout_s=self.cfg.deadlines.startup_s)
        spec = sync_group_spec(self.run, host=self.host, port=self._store.port,
                               prefix=f"sync/{self.groups_formed}/",
                               timeout_s=self.cfg.deadlines.sync_s,
                               engines=self.engines.num_engines)
        self.groups_formed += 1
        for sender in (self._plan_sender, self._adapter_sender):
            if sender is not None:  # members may be new: the next sync sends the whole plan
                sender.joined()
        # a base no warm-up trained is the one every engine loads at start-up
        self._base_current = self.cfg.warmup.max_steps == 0
        # each engine rank checks, once joined, that the plan writes exactly its parameters
        self.engines.start_join_sync_group(spec, self.cfg.actor.world_size,
                                           devices=self.run.engine_devices, plan=self.plan)
        self.actors.wait([w.join_sync_group.remote(spec, self.run.actor_devices[rank])
                          for rank, w in enumerate(self.actors.workers)], "sync-join")
        self.engines.finish_join_sync_group()

    def rejoin_after_restart(self, survivors: list[int]) -> None:
        """A member was lost, so the group is broken for everyone: the actor ranks leave it,
        the surviving engines wait out their failed install and leave, and all join anew."""
        self.actors.call("leave_sync_group", phase="sync-join")
        self.engines.abandon_sync(survivors)
        self.join_group()

    def admit_late_engines(self, wait: bool = False) -> list[int]:
        """Late engines (rollout.startup_engines) that are up join the run: the sync group is
        re-formed with them and the plan rebuilt for the new engine count; the sync that
        follows gives them the actor's weights (call it only where a sync follows). wait:
        until every late engine is up. Returns the engines that joined."""
        joined = self.engines.admit_late_engines(wait=wait)
        if not joined:
            return joined
        self.actors.call("leave_sync_group", phase="sync-join")
        self.engines.leave_sync_group()  # a no-op on the engines that just joined
        self._build_plan()
        self.join_group()
        print(f"mcore-rl: rollout engine(s) {joined} up (start-up "
              f"{', '.join(f'{self.engines.startup_s[i]:.1f}' for i in joined)} s) and "
              f"joined: {self.engines.num_engines} of {self.cfg.rollout.engines} engines "
              "generate from this sync on", flush=True)
        return joined

    def adapters_attached(self) -> None:
        """The actor carries its LoRA adapters from now on (after a warm-up)."""
        self.adapters_on = True

    def sync_once(self) -> dict[str, float]:
        """One sync into every engine of the group; raises SyncFailed naming the engines
        that died (rl/recovery.py restarts them). With adapter sync: the adapters, after the
        base when the engines' is not the actor's (module doc)."""
        if not (self.adapter_sync and self.adapters_on):
            return self._sync(self._plan_sender, merged=True)
        stats = {}
        if not self._base_current:
            stats = self._sync(self._plan_sender, merged=False)
            self._base_current = True
        adapter = self._sync(self._adapter_sender, merged=False, adapter=True)
        return {**{k: stats.get(k, 0.0) + adapter[k]
                   for k in ("sync_bytes", "sync_bytes_ipc", "sync_bytes_in_place",
                             "sync_digest_s", "sync_compare_s")},
                "sync_adapter_bytes": adapter["sync_bytes"]}

    def _sync(self, sender: PlanSender, *, merged: bool, adapter: bool = False
              ) -> dict[str, float]:
        plan = sender.payload()  # the whole plan once per group, then its reference
        self.engines.begin_sync(plan, dtype=torch_dtype(self.cfg.wire_dtype),
                                timeout_s=self.cfg.deadlines.sync_s, adapter=adapter)
        self.kills.inject("sync")
        stats = self.finish_sync(plan, merged=merged)
        sender.delivered()
        return stats

    def finish_sync(self, plan, *, merged: bool = True) -> dict[str, float]:
        """The trainer side of a started sync. A failure is blamed on the engines that died,
        by name, when there are any (a bare transport error only says a peer left).
        Every sync is verified (resharding/digest.py): `sync_digest_s` is what digesting cost
        the slowest rank (what it sent or installed), `sync_compare_s` the comparison's own
        time (the rank that reached it last waited least). `sync_bytes_in_place`: the bytes
        the engines received straight into their parameters (no install copy)."""
        try:
            stats = self.actors.call("send_weights", plan, self.cfg.wire_dtype,
                                     self.cfg.deadlines.sync_s, merged, phase="sync")
            reports = self.engines.finish_sync()
        except WatchdogTimeout:
            raise
        except Exception as err:
            dead = self.engines.dead_engines()
            if dead:
                raise SyncFailed(f"weight sync failed: rollout engine(s) {dead} died or stopped "
                                 f"answering during the sync ({type(err).__name__}: "
                                 f"{_last_line(err)})") from err
            raise
        ranks = [r for report in reports for r in report.ranks]
        return {"sync_bytes": float(sum(s["bytes_sent"] for s in stats)),
                "sync_bytes_ipc": float(sum(s.get("bytes_sent_ipc", 0) for s in stats)),
                "sync_bytes_in_place": float(sum(r.bytes_in_place for r in ranks)),
                "sync_digest_s": float(max([s["digest_seconds"] for s in stats] +
                                           [r.digest_seconds for r in ranks])),
                "sync_compare_s": float(min([s["compare_seconds"] for s in stats] +
                                            [r.compare_seconds for r in ranks]))}


__all__ = ["SyncFailed", "WeightSync"]
