"""The actor's Ray workers, one per Megatron rank (mcore_rl/workers/actor.py), as the
controller sees them: a call on every rank under the phase's deadline, and per-token passes
assembled over data parallelism."""

from __future__ import annotations

from pathlib import Path

import torch

from mcore_rl.config.seeds import derive_seed
from mcore_rl.launch.watchdog import Watchdog, collect_or_name_dead, still_running
from mcore_rl.models.kernels import dropped_on_ranks
from mcore_rl.models.spec import ModelSpec
from mcore_rl.resharding import host_store
from mcore_rl.rollout.batches import Batch, dp_slice
from mcore_rl.runconfig import RLConfig
from mcore_rl.runconfig.resolve import ResolvedRun
from mcore_rl.workers.actor import ActorRankSpec, ActorWorker


def actor_rank_spec(cfg: RLConfig, run: ResolvedRun, model: ModelSpec, hf_dir: str, *,
                    critic: bool, reference: bool, stack_dir: str,
                    slots: tuple[int | None, ...]):
    """The `ActorRankSpec` every actor rank of the run is built from: `cfg`'s actor, trainers
    and deadlines, `run`'s devices, layer spec and kernel choices, the placement's `slots`."""
    return ActorRankSpec(
        model=model, parallel=cfg.actor, train=cfg.warmup.train, hf_dir=hf_dir,
        timeout_s=cfg.deadlines.train_s, critic_train=cfg.critic_train if critic else None,
        reference=reference, seed=derive_seed(cfg.seed, "train"), layer_spec=run.layer_spec,
        fused_kernels=run.fused_kernels, overlap_grad_reduce=run.overlap_grad_reduce,
        compiled_fusions=run.compiled_fusions, lora=cfg.actor.lora,
        lora_from_start=cfg.warmup.max_steps == 0,
        routing_replay=cfg.algorithm.routing_replay != "none",
        release_cache=run.release_trainer_cache, stack_dir=stack_dir,
        inject_stall=cfg.inject_stall, devices=tuple(run.actor_devices), slots=slots)


class ActorRanks:
    """Starts the ranks in the placement's slots and calls them. The actor world meets at a
    store the controller hosts (not on whichever node rank 0 lands), so no worker needs to
    know another node's address."""

    def __init__(self, cfg: RLConfig, model_dir: Path, *, spec, run, placement, host: str,
                 watchdog: Watchdog, critic: bool, reference: bool):
        import ray  # lazy: ray

        self.deadlines, self.watchdog, self.dp = cfg.deadlines, watchdog, cfg.actor.dp
        self.pids: list[int] = []  # known once the ranks answer (`wait_started`)
        self.dp_ranks: list[int] = []  # each rank's DP slice (`wait_started`)
        self.kernels: list[list[dict]] = []  # each rank's fused kernels (`wait_started`)
        self._output_slots: list[int | None] | None = None  # fixed by the grid: asked once
        # rank -> its call that missed a deadline (shutdown does not wait for it to answer:
        # launch.watchdog.still_running)
        self._unanswered: dict[int, object] = {}
        world = cfg.actor.world_size
        self._store = host_store(host, world_size=world + 1, timeout_s=cfg.deadlines.startup_s)
        slots, remote_cls = placement.plan.actor, ray.remote(num_cpus=0)(ActorWorker)
        rank_spec = actor_rank_spec(cfg, run, spec, str(model_dir), critic=critic,
                                    reference=reference, stack_dir=str(watchdog.stack_dir),
                                    slots=tuple(slot.device for slot in slots))
        self.workers = [remote_cls.options(**placement.options_for_node(slots[rank].node)).remote(
            rank, world, (host, self._store.port), rank_spec)
            for rank in range(world)]
        watchdog.watch("rank", lambda: self.pids)

    def wait_started(self) -> None:
        """Every rank up (model built, weights loaded), under the start-up deadline. Each
        rank reports the fused kernels it turned on (`kernels`); one the plan asked for that
        a rank's node cannot run is said in one line."""
        self.pids = self.call("pid", phase="startup")
        self.dp_ranks = self.call("dp_rank", phase="startup")
        self.kernels = self.call("fused_kernels", phase="startup")
        for line in dropped_on_ranks(self.kernels):
            print(f"mcore-rl: {line}", flush=True)

    def wait(self, refs: list, phase: str) -> list:
        """The ranks' results under the phase's deadline; past it, the watchdog names who is
        late (a rank that died is named at once)."""
        deadline = self.deadlines.for_phase(phase)
        # results as they arrive: a rank that died fails the phase at once, by name, rather
        # than after its peers' collective timeout
        values = collect_or_name_dead(refs, deadline, phase, self.pids or None)
        if len(values) < len(refs):
            self._unanswered.update((i, ref) for i, ref in enumerate(refs) if i not in values)
            late = [f"actor rank {i}" for i in range(len(refs)) if i not in values]
            raise self.watchdog.timeout(phase, deadline, late)
        return [values[i] for i in range(len(refs))]

    def call(self, method: str, *args, phase: str) -> list:
        """`method(*args)` on every rank; their results in rank order."""
        return self.wait([getattr(w, method).remote(*args) for w in self.workers], phase)

    def call_rows(self, method: str, rows: dict[str, torch.Tensor], *args, phase: str,
                  mini_batches: int = 1) -> list:
        """`method(my_rows, *args)` on every rank, each getting only its DP slice of `rows`
        (`dp_slice`, of each of `mini_batches` mini-batches): every slice is put into Ray's
        object store once and read by the ranks of that slice (TP, PP, CP peers), rather
        than the whole batch serialized once per rank."""
        import ray  # lazy: ray

        slices = [ray.put(dp_slice(rows, self.dp, d, mini_batches)) for d in range(self.dp)]
        return self.wait([getattr(w, method).remote(slices[d], *args)
                          for w, d in zip(self.workers, self.dp_ranks)], phase)

    @staticmethod
    def _pass_rows(batch: Batch, routing: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = {"tokens": batch.tokens, "labels": batch.labels, "response_mask": batch.mask}
        if routing is not None:
            rows["routing"] = routing
        return rows

    def per_token(self, method: str, batch: Batch, phase: str,
                  routing: torch.Tensor | None = None) -> torch.Tensor:
        """A forward-only pass on every rank; one [n, s] result, assembled over DP. The
        response mask tells packed passes where each row's real tokens end. routing: the
        experts the pass replays ([n, s, layers, k])."""
        outs = self.call_rows(method, self._pass_rows(batch, routing), phase=phase)
        if self._output_slots is None:
            self._output_slots = self.call("dp_rank_of_output", phase=phase)
        by_dp = {dp: out for dp, out in zip(self._output_slots, outs) if dp is not None}
        return torch.cat([by_dp[d] for d in range(self.dp)])

    def logprobs_and_routing(self, batch: Batch, phase: str) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
        """The old log-probs [n, s] and the experts the actor's MoE routers chose for every
        token, [n, s, layers, k]: each DP slice's rows, every pipeline stage's layers."""
        outs = self.call_rows("logprobs_and_routing", self._pass_rows(batch), phase=phase)
        logp = {o["dp"]: o["logp"] for o in outs if o["logp"] is not None}
        routing: dict[int, torch.Tensor] = {}
        for o in outs:  # each stage holds its layers, -1 in the others'
            if o["routing"] is not None:
                have = routing.get(o["dp"])
                routing[o["dp"]] = (o["routing"] if have is None
                                    else torch.maximum(have, o["routing"]))
        return (torch.cat([logp[d] for d in range(self.dp)]),
                torch.cat([routing[d] for d in range(self.dp)]))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to leave its groups (one still inside a call that missed its
        deadline is not asked; one stuck in a collective does not answer), then kill every
        rank's actor: the Ray they ran in may outlive the run (`RLController.owns_ray`)."""
        import ray  # lazy: ray

        stuck = still_running(self._unanswered)
        refs = [w.shutdown.remote() for i, w in enumerate(self.workers) if i not in stuck]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for worker in self.workers:
            ray.kill(worker, no_restart=True)


__all__ = ["ActorRanks"]
