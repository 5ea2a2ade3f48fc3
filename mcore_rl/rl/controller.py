"""The single controller of an RL run (GRPO family).

It owns the data flow and the clock; workers own the compute. Per step:
generate (vLLM engines) → reward (rule function, reward model) → old log-probs (Megatron
actor) → advantages → policy update (mini-batches) → weight sync (streamed shards, timed as
its own phase, never billed to the actor). Every remote wait has a deadline; a phase that
misses it ends the run with a `WatchdogTimeout` naming the phase, the workers that did not
arrive, and the stack dumps every worker wrote (mcore_rl/launch/watchdog.py).

The controller is split by concern: generation, scoring and the batches ahead
(rl/sampler.py), the weight sync (rl/weight_sync.py), checkpoints
(rl/checkpointer.py), batch building (rollout/batches.py), advantages
(rl/advantages.py), engine recovery (rl/recovery.py). This module starts the
workers and runs the step's phases.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mcore_rl.algorithms import correction_weights, overlong_penalty
from mcore_rl.config.seeds import derive_seed
from mcore_rl.launch.watchdog import WatchdogTimeout, collect_or_name_dead, dump_stacks
from mcore_rl.models.spec import ModelSpec
from mcore_rl.planning.resolve import resolve_run
from mcore_rl.resharding import host_store
from mcore_rl.rollout.multi_turn import build_multi_turn, episode_metrics, loss_masks
from mcore_rl.tasks.base import load_reward_fn
from mcore_rl.tasks.config import DEFAULT_REWARDS, build_reward, build_task
from mcore_rl.tasks.tokenizer import encode_answers, load_tokenizer
from mcore_rl.rl.advantages import compute_advantages, critic_metrics, packing_metrics
from mcore_rl.rollout.batches import (Batch, Rollouts, build_batch, engine_logprobs,
                                      rollout_logprob_diff, trained_tokens)
from mcore_rl.rl.checkpointer import Checkpointing
from mcore_rl.rl.sampler import Generation
from mcore_rl.launch.timing import PhaseTimer
from mcore_rl.rollout.partial import current_version_logprob_diff
from mcore_rl.rl.recovery import EngineFailed, EngineRecovery
from mcore_rl.rl.weight_sync import SyncFailed, WeightSync

if TYPE_CHECKING:  # the run layer above builds both and hands them in
    from mcore_rl.run.config import RLConfig
    from mcore_rl.run.metrics import MetricsWriter


def driver_address() -> str:
    """The address this controller's stores listen on: MCORE_RL_NODE_IP (set per node by the
    SLURM launcher) or loopback — never all interfaces."""
    return os.environ.get("MCORE_RL_NODE_IP", "127.0.0.1")


class RLController(Generation, WeightSync, Checkpointing):
    """Owns the Ray workers (actor ranks, rollout engines, reward model), the sync plan and
    the loop."""

    def __init__(self, cfg: RLConfig, model_dir: Path, run_dir: Path):
        from mcore_rl.launch.placement import RayPlacement
        from mcore_rl.rollout.ray_engines import RayEngines
        from mcore_rl.launch.ray_runtime import init_local_ray

        self.cfg, self.run_dir = cfg, Path(run_dir)
        # the watchdog names whoever has started so far: nothing yet
        self.worker_pids: list[int] = []
        self.engines = self.reward_model = None
        self._output_slots: list[int | None] | None = None  # fixed by the grid: asked once
        self.spec = ModelSpec.from_hf_dir(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.task = build_task(cfg.task)
        # prompts over max_prompt_tokens: an error now, or dropped (task.overlong_prompts)
        self.prompt_metrics = self.fit_prompts()
        self.reward = build_reward(cfg.task)
        # held-out accuracy is the task's exact-match reward, whatever reward RL trains on
        self.exact_match = load_reward_fn(DEFAULT_REWARDS[cfg.task.kind])
        # multi-turn tasks: episodes with an environment between turns (None: single-turn)
        self.multi_turn = build_multi_turn(cfg.task, self.tokenizer, self.reward)
        init_local_ray(num_cpus=max(2, os.cpu_count() or 2))
        self.host = driver_address()
        # every device, backend and transport choice of the run, decided once
        self.run = resolve_run(cfg)
        self.placement = RayPlacement(self.run.placement,
                                      cpus_per_engine=cfg.rollout.cpus_per_engine,
                                      gpu=self.run.device == "cuda",
                                      timeout_s=cfg.deadlines.startup_s)
        self.use_critic = cfg.algorithm.advantage_estimator == "gae"
        self.use_reference = cfg.algorithm.kl_coeff > 0
        self.stack_dir = self.run_dir / "stacks"
        self.workers = self._start_actor_ranks(model_dir)
        # the engines start while the actor ranks initialise; both waits keep their deadline
        self.engines = RayEngines(model_dir, cfg.rollout,
                                  start_timeout_s=cfg.deadlines.startup_s,
                                  call_timeout_s=cfg.deadlines.engine_call_s,
                                  stack_dir=self.stack_dir,
                                  inject_stall=cfg.inject_stall, placement=self.placement,
                                  seed=derive_seed(cfg.seed, "engine"), wait=False)
        try:
            self.worker_pids = self.call_actors("pid", phase="startup")
            self.reward_model = self._start_reward_model()
        except BaseException:  # no engine outlives a start-up that failed
            self.engines.shutdown(grace_s=5.0)
            raise
        self.engines.wait_ready()
        self.recovery = EngineRecovery(self, cfg.recovery)  # engines that die are restarted
        self._build_plan()
        self._sync_groups_formed = 0
        self.join_sync_group()
        self.pipeline = self._start_pipeline()  # one_step / async: the batches ahead
        # rollout.startup_engines: the rest start now that the run is up, and join at a sync
        self.engines.start_late_engines()

    def _start_actor_ranks(self, model_dir: Path) -> list:
        """The actor's Ray workers, one per rank, in the placement's slots. The actor world
        meets at a store the controller hosts (not on whichever node rank 0 lands), so no
        worker needs to know another node's address."""
        import ray

        from mcore_rl.workers.actor import ActorWorker

        cfg, world = self.cfg, self.cfg.actor.world_size
        self._actor_store = host_store(self.host, world_size=world + 1,
                                       timeout_s=cfg.deadlines.startup_s)
        slots, remote_cls = self.placement.plan.actor, ray.remote(num_cpus=0)(ActorWorker)
        return [remote_cls.options(**self.placement.options_for_node(slots[rank].node)).remote(
            rank, world, (self.host, self._actor_store.port), self.spec, cfg.actor,
            cfg.warmup.train, str(model_dir),
            cfg.deadlines.train_s, critic_train=cfg.critic_train if self.use_critic else None,
            reference=self.use_reference, stack_dir=str(self.stack_dir),
            inject_stall=cfg.inject_stall, device=slots[rank].device,
            layer_spec=self.run.layer_spec, seed=derive_seed(cfg.seed, "train"))
            for rank in range(world)]

    # --- plumbing ---------------------------------------------------------------------------

    def _wait(self, refs: list, phase: str) -> list:
        """The workers' results under the phase's deadline; past it, the watchdog names who is
        late (a worker that died is named at once)."""
        deadline = self.cfg.deadlines.for_phase(phase)
        # results as they arrive: a rank that died fails the phase at once, by name, rather
        # than after its peers' collective timeout
        values = collect_or_name_dead(refs, deadline, phase, self.worker_pids or None)
        if len(values) < len(refs):
            late = [f"actor rank {i}" for i in range(len(refs)) if i not in values]
            raise self._watchdog(phase, deadline, late)
        return [values[i] for i in range(len(refs))]

    def _watchdog(self, phase: str, deadline: float, late: list[str],
                  detail: str = "") -> WatchdogTimeout:
        """Every worker (actor ranks and engines) dumps its stacks; the error names the phase,
        the late workers and the dump files."""
        pids = {f"rank{i}": pid for i, pid in enumerate(self.worker_pids)}
        if self.reward_model is not None:
            pids.update({f"reward_rank{i}": pid for i, pid in enumerate(self.reward_model.pids)})
        if self.engines is not None:
            pids.update({f"engine{i}": pid for i, pid in enumerate(self.engines.pids)})
        return WatchdogTimeout(phase, deadline, late, dump_stacks(pids, self.stack_dir),
                               detail)

    def call_actors(self, method: str, *args, phase: str) -> list:
        return self._wait([getattr(w, method).remote(*args) for w in self.workers], phase)

    def _per_token(self, method: str, batch: Batch, phase: str) -> torch.Tensor:
        """A forward-only pass on every worker; one [n, s] result, assembled over DP. The
        response mask tells packed passes where each row's real tokens end."""
        outs = self.call_actors(method, batch.tokens, batch.labels, batch.mask, phase=phase)
        if self._output_slots is None:
            self._output_slots = self._wait([w.dp_rank_of_output.remote()
                                             for w in self.workers], phase)
        by_dp = {dp: out for dp, out in zip(self._output_slots, outs) if dp is not None}
        return torch.cat([by_dp[d] for d in range(self.cfg.actor.dp)])

    # --- warm-up ----------------------------------------------------------------------------

    def warmup(self, writer: MetricsWriter) -> float:
        """Supervised steps on noisy answers until held-out accuracy is reached (greedy, or
        sampled at `warmup.eval_temperature`)."""
        w = self.cfg.warmup
        acc = 0.0
        for step in range(1, w.max_steps + 1):
            timer = PhaseTimer()
            examples = self.task.warmup_examples(w.batch_size, seed=self.cfg.seed * 100003 + step,
                                                 p=w.label_noise)
            prompts = self.encode_all([p for p, _ in examples])
            if self.multi_turn is None:
                answers, masks = encode_answers(self.tokenizer, [a for _, a in examples]), None
            else:  # whole traces; their observations are masked out of the loss
                answers, masks = zip(*(self.multi_turn.encode_trace(a) for _, a in examples))
            batch = build_batch(prompts, answers, w.train.seq_len, self.tokenizer.pad_token_id,
                                masks)
            with timer("update_actor"):
                result = self.call_actors("sft_step", batch.tokens, batch.labels, batch.mask,
                                     phase="warmup")[0]
            metrics = {"loss": result["loss"], "grad_norm": result["grad_norm"]}
            if step % w.eval_every == 0:
                with timer("sync"):
                    self.sync_weights()
                with timer("gen"):
                    acc = self.accuracy(w.eval_prompts, w.eval_temperature)
                metrics["accuracy"] = acc
                writer.write(step, {**metrics, **timer.as_metrics()})
                if acc >= w.target_accuracy:
                    break
        return acc

    # --- RL ---------------------------------------------------------------------------------

    def reset_optimizer(self) -> None:
        self.call_actors("reset_optimizer", self.cfg.train, phase="setup")

    def rl_step(self, step: int) -> dict[str, float]:
        """One RL step (module doc); its metrics. An engine lost for good in the step's sync
        is raised after the step's metrics are attached to it (the run loop logs them)."""
        cfg, timer = self.cfg, PhaseTimer()
        self.recovery.begin_step(step)
        engines = self.engines.num_engines  # in the run as the step starts (late ones join)
        rollouts, gen_timing = self._rollouts_for(step, timer)
        if cfg.rollout.enable_sleep:  # colocated on GPU: free the KV cache while training
            with timer("sleep"):
                self.engines.sleep()
        batch, completions, scores = self._train_batch(rollouts)
        trained = trained_tokens(completions, batch.mask)  # raises if the loss has no token
        train_start = time.perf_counter()
        old_logp, is_weights, mismatch = self._old_policy(batch, completions, step, timer)
        extra = self._reference_and_values(batch, timer)
        with timer("adv"):
            groups = torch.arange(len(rollouts.prompt_ids)).repeat_interleave(
                cfg.samples_per_prompt)
            adv, returns, adv_metrics = compute_advantages(cfg.algorithm, scores, groups,
                                                           batch.mask, old_logp, extra)
        updates = self._update_actor(batch, old_logp, adv, extra, is_weights, timer)
        if cfg.algorithm.rollout_correction.mode == "bypass":
            # π_old is the engine's: the first mini-batch's forward, on the weights the engine
            # sampled with, measures the mismatch the skipped pass would have (~0: exact sync)
            mismatch = {"rollout_logprob_max_diff": updates[0]["logp_moved"]}
        critic_updates = self._update_critic(batch, extra, returns, timer)
        self.recovery.step_trained()
        # weights must not change under a running generation: wait for the batches ahead
        overlap = ({} if self.pipeline is None else
                   self.pipeline.quiesce(timer, (train_start, time.perf_counter())))
        if cfg.rollout.enable_sleep:
            with timer("wake"):
                self.engines.wake_up()
        lost = None  # an engine failed past its restarts in the sync: report the step first
        with timer("sync"):
            try:
                sync = self.sync_weights()
            except EngineFailed as failed:
                lost, sync = failed, {}
        metrics = {"reward_mean": float(scores.mean()), "reward_std": float(scores.std()),
                   "rollout_engines": float(engines),
                   **_update_metrics(updates), **mismatch, **adv_metrics,
                   **critic_metrics(critic_updates), **sync, **rollouts.stats,
                   **timer.as_metrics(), **gen_timing, **overlap,
                   **episode_metrics(completions), **self.recovery.metrics(),
                   **trained, **self.prompt_metrics}
        gen_tokens = float(batch.mask.sum())
        metrics["response_length"] = gen_tokens / len(completions)
        metrics["tokens_per_s"] = gen_tokens / max(metrics["timing_s/gen"], 1e-9)
        if lost is not None:
            lost.step_metrics = metrics
            raise lost
        return metrics

    def _train_batch(self, rollouts: Rollouts):
        """(batch, completions, scores): the rollouts as one [n, s] batch, a row per sample,
        and the samples' scores (with DAPO's overlong penalty when configured)."""
        cfg = self.cfg
        outs = rollouts.completions
        flat_prompts = [p for p, o in zip(rollouts.prompt_ids, outs) for _ in o]
        completions = [c for o in outs for c in o]
        scores = torch.tensor([s for group in rollouts.scores for s in group])
        batch = build_batch(flat_prompts, [c.token_ids for c in completions],
                            cfg.train.seq_len, self.tokenizer.pad_token_id,
                            loss_masks(completions))
        if cfg.algorithm.overlong_buffer:
            scores = scores + overlong_penalty(
                batch.mask.sum(-1), max_response_length=cfg.max_new_tokens,
                overlong_buffer=cfg.algorithm.overlong_buffer,
                penalty_factor=cfg.algorithm.overlong_penalty)
        return batch, completions, scores

    def _old_policy(self, batch: Batch, completions, step: int, timer: PhaseTimer):
        """(π_old log-probs, importance weights or None, mismatch metrics). bypass: the
        engine's log-probs are π_old; otherwise the actor's (a forward pass), compared with
        the engine's and corrected by `algorithm.rollout_correction`."""
        correction = self.cfg.algorithm.rollout_correction
        rollout_logp = engine_logprobs(completions, batch.mask)
        if correction.mode == "bypass":  # the engine's log-probs are the old policy
            return rollout_logp, None, {}
        skip = self._old_logp_rows_from_update(batch.tokens.shape[0])
        rest = Batch(batch.tokens[skip:], batch.labels[skip:], batch.mask[skip:])
        with timer("old_logprob"):
            passed = self._per_token("logprobs", rest, "old_logprob")
        # the first `skip` rows: NaN, the update's own forward (rl_step.PolicyBatch)
        old_logp = torch.cat([torch.full((skip, passed.shape[1]), float("nan")), passed])
        completions, mask = completions[skip:], rest.mask
        # vLLM's log-probs of its samples vs the actor's on the same (synced) weights: ~0
        # means the weight sync is exact; it grows if the engine serves stale weights (and
        # off-policy it measures the staleness)
        mismatch = {"rollout_logprob_max_diff": rollout_logprob_diff(completions, passed, mask),
                    "old_logprob_rows": float(len(passed))}
        # partial rollouts: the tokens generated on these very weights must match exactly
        mismatch.update(current_version_logprob_diff(completions, passed, mask,
                                                     version=step - 1))
        is_weights, correction_metrics = correction_weights(correction, passed,
                                                            rollout_logp[skip:], mask)
        return old_logp, is_weights, {**mismatch, **correction_metrics}

    def _old_logp_rows_from_update(self, rows: int) -> int:
        """Rows whose π_old is the first mini-batch's own update forward (0: none), see
        `AlgorithmConfig.old_logprob_from_update`."""
        cfg = self.cfg
        algo = cfg.algorithm
        if (not algo.old_logprob_from_update or cfg.updates_per_batch < 2
                or algo.rollout_correction.mode != "none" or algo.kl_in_reward):
            return 0
        return rows // cfg.updates_per_batch

    def _reference_and_values(self, batch: Batch, timer: PhaseTimer) -> dict[str, torch.Tensor]:
        """The reference's log-probs (a KL term is configured) and the critic's values (GAE)."""
        extra: dict[str, torch.Tensor] = {}
        if self.use_reference:
            with timer("ref"):
                extra["ref_logp"] = self._per_token("ref_logprobs", batch, "ref")
        if self.use_critic:
            with timer("values"):
                extra["values"] = self._per_token("values", batch, "values")
        return extra

    def _update_actor(self, batch: Batch, old_logp, adv, extra, is_weights,
                      timer: PhaseTimer) -> list[dict]:
        """The policy update, one call per mini-batch; each call's report."""
        cfg = self.cfg
        policy = {"tokens": batch.tokens, "labels": batch.labels, "response_mask": batch.mask,
                  "old_logp": old_logp, "advantages": adv}
        if self.use_reference and cfg.algorithm.kl_mode == "loss":
            policy["ref_logp"] = extra["ref_logp"]
        if is_weights is not None:
            policy["is_weights"] = is_weights
        with timer("update_actor"):  # every mini-batch in one call (ActorWorker.update)
            per_rank = self.call_actors("update", policy, cfg.algorithm, cfg.updates_per_batch,
                                   phase="update_actor")
        return [_global_update_report([rank[k] for rank in per_rank])
                for k in range(cfg.updates_per_batch)]

    def _update_critic(self, batch: Batch, extra, returns, timer: PhaseTimer) -> list[dict]:
        """The critic's value update (GAE only), every mini-batch in one call."""
        if not self.use_critic:
            return []
        value = {"tokens": batch.tokens, "labels": batch.labels, "response_mask": batch.mask,
                 "old_values": extra["values"], "returns": returns}
        with timer("update_critic"):
            return self.call_actors("critic_update", value, self.cfg.algorithm,
                               self.cfg.updates_per_batch, phase="update_critic")[0]

    def shutdown(self) -> None:
        """Stop workers and engines; a worker stuck in a collective is killed with Ray."""
        import ray

        from mcore_rl.launch.ray_runtime import stop_local_ray

        if self.pipeline is not None:
            self.pipeline.shutdown()
        try:
            ray.wait([w.shutdown.remote() for w in self.workers],
                     num_returns=len(self.workers), timeout=10.0)
            self.engines.shutdown()
            if self.reward_model is not None:
                self.reward_model.shutdown()
            self.placement.remove()
        finally:
            stop_local_ray()


def _global_update_report(per_rank: list[dict]) -> dict[str, float]:
    """One mini-batch's update report: the global metrics (the same on every rank) and
    logp_moved, the largest of the ranks' own (see rl_step.policy_update)."""
    report = {k: v for k, v in per_rank[0].items() if k != "logp_moved_local"}
    moved = [r["logp_moved_local"] for r in per_rank
             if not math.isnan(r["logp_moved_local"])]
    report["logp_moved"] = max(moved, default=float("nan"))
    return report


def _update_metrics(updates: list[dict]) -> dict[str, float]:
    """The policy update's report: the last mini-batch's losses (the first's entropy: before
    any update moved the policy) and its sequence packing."""
    last = updates[-1]
    return {"pg_loss": last["pg_loss"], "clip_frac": last["clip_frac"],
            "ppo_kl": last["ppo_kl"], "entropy": updates[0]["entropy"],
            "grad_norm": last["grad_norm"], "kl_ref": last["kl_ref"], **packing_metrics(last)}


__all__ = ["Batch", "RLController", "Rollouts", "SyncFailed", "build_batch", "driver_address"]
