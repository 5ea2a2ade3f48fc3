"""The single controller of an RL run (GRPO family).

It owns the data flow and the clock; workers own the compute. Per step:
generate (vLLM engines) → reward (rule function, reward model) → old log-probs (Megatron
actor) → advantages → policy update (mini-batches) → weight sync (streamed shards, timed as
its own phase, never billed to the actor). Every remote wait has a deadline; a phase that
misses it ends the run with a `WatchdogTimeout` naming the phase, the workers that did not
arrive, and the stack dumps every worker wrote (mcore_rl/launch/watchdog.py).

The controller starts the workers and hands them to its components, each built with what
it uses: the actor ranks (rl/actor_ranks.py), generation and scoring (rl/sampler.py), the
weight sync (rl/weight_sync.py), checkpoints (rl/checkpointer.py) and engine recovery
(rl/recovery.py). This module runs the step's phases; batch building is
rollout/batches.py, advantages rl/advantages.py.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

import torch

from mcore_rl.algorithms import correction_weights, overlong_penalty
from mcore_rl.config.seeds import derive_seed
from mcore_rl.launch.placement import RayPlacement
from mcore_rl.launch.ray_runtime import init_local_ray, stop_local_ray
from mcore_rl.launch.timing import PhaseTimer
from mcore_rl.launch.watchdog import Watchdog
from mcore_rl.models.spec import ModelSpec
from mcore_rl.rl.actor_ranks import ActorRanks
from mcore_rl.rl.advantages import compute_advantages, critic_metrics, packing_metrics
from mcore_rl.rl.checkpointer import Checkpointer
from mcore_rl.rl.evaluation import GenerationLog
from mcore_rl.rl.metrics import MetricsWriter
from mcore_rl.rl.recovery import EngineFailed, EngineRecovery, InjectedKills
from mcore_rl.rl.sampler import Sampler, fit_prompts, start_pipeline, start_reward_model
from mcore_rl.rl.weight_sync import SyncFailed, WeightSync
from mcore_rl.rollout.batches import (
    Batch,
    Rollouts,
    build_batch,
    engine_logprobs,
    rollout_logprob_diff,
    trained_tokens,
)
from mcore_rl.rollout.engine import RolloutError
from mcore_rl.rollout.lora import EngineLoRA
from mcore_rl.rollout.multi_turn import build_multi_turn, episode_metrics, loss_masks
from mcore_rl.rollout.partial import current_version_logprob_diff
from mcore_rl.rollout.ray_engines import RayEngines
from mcore_rl.runconfig import RLConfig
from mcore_rl.runconfig.resolve import resolve_run
from mcore_rl.tasks.config import build_reward, build_task
from mcore_rl.tasks.tokenizer import load_tokenizer


def driver_address() -> str:
    """The address this controller's stores listen on: MCORE_RL_NODE_IP (set per node by the
    SLURM launcher) or loopback — never all interfaces."""
    return os.environ.get("MCORE_RL_NODE_IP", "127.0.0.1")


class RLController:
    """Owns the Ray workers (actor ranks, rollout engines, reward model), the components
    that use them (sampler, weight sync, checkpointer, engine recovery) and the RL step."""

    def __init__(self, cfg: RLConfig, model_dir: Path, run_dir: Path,
                 sampler_cls: type[Sampler] = Sampler, *, owns_ray: bool = False):
        """owns_ray: the caller started Ray for this run (`start_local_ray` returned True)
        and hands it over; else the controller owns Ray only if it starts it itself. The
        owner's `shutdown` stops Ray; a Ray that was up already is left up."""
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.spec = ModelSpec.from_hf_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
        task, reward = build_task(cfg.task), build_reward(cfg.task)
        # prompts over max_prompt_tokens: an error now, or dropped (task.overlong_prompts)
        self.prompt_metrics = fit_prompts(cfg, task, tokenizer)
        multi_turn = build_multi_turn(cfg.task, tokenizer, reward)
        self.owns_ray = init_local_ray(num_cpus=max(2, os.cpu_count() or 2)) or owns_ray
        # every device, backend and transport choice of the run, decided once
        self.run = resolve_run(cfg)
        self.pipeline = self.reward_model = None
        try:
            self._start(cfg, model_dir, tokenizer, task, reward, multi_turn, sampler_cls)
        except BaseException:  # nothing a start-up that failed started outlives it
            self._stop_workers(engine_grace_s=5.0)
            raise

    def _start(self, cfg: RLConfig, model_dir: Path, tokenizer, task, reward, multi_turn,
               sampler_cls: type[Sampler]) -> None:
        """The workers (placement group, actor ranks, engines, reward model) and the
        components that use them."""
        host = driver_address()
        self._start_workers(cfg, model_dir, tokenizer, host)
        self._build_components(cfg, tokenizer, task, reward, multi_turn, sampler_cls, host)
        # rollout.startup_engines: the rest start now that the run is up, and join at a sync
        self.engines.start_late_engines()

    def _start_workers(self, cfg: RLConfig, model_dir: Path, tokenizer, host: str) -> None:
        """The placement group, the actor ranks, the engines and the reward model, all up (in
        the order the resolved run asks for), each watched by the watchdog."""
        self.placement = RayPlacement(self.run.placement,
                                      cpus_per_engine=cfg.rollout.cpus_per_engine,
                                      gpu=self.run.device == "cuda",
                                      timeout_s=cfg.deadlines.startup_s)
        self.use_critic = cfg.algorithm.advantage_estimator == "gae"
        self.use_reference = cfg.algorithm.kl_coeff > 0
        # names every worker started so far when a phase misses its deadline
        self.watchdog = Watchdog(self.run_dir / "stacks")
        self.actors = ActorRanks(cfg, model_dir, spec=self.spec, run=self.run,
                                 placement=self.placement, host=host, watchdog=self.watchdog,
                                 critic=self.use_critic, reference=self.use_reference)

        def start_trainers() -> None:
            """The actor ranks up, then the reward model's ranks (on the actor's devices)."""
            self.actors.wait_started()
            self.reward_model = start_reward_model(cfg, tokenizer, host=host,
                                                   stack_dir=self.watchdog.stack_dir,
                                                   placement=self.placement, run=self.run)
            if self.reward_model is not None:
                self.watchdog.watch("reward_rank", lambda: self.reward_model.pids)

        if self.run.trainers_first:  # devices shared with the engines: see ResolvedRun
            start_trainers()
        # otherwise the engines start while the trainers initialise; each wait keeps its
        # deadline
        self.engines = RayEngines(model_dir, self.run.engine_config(cfg.rollout),
                                  start_timeout_s=cfg.deadlines.startup_s,
                                  call_timeout_s=cfg.deadlines.engine_call_s,
                                  stack_dir=self.watchdog.stack_dir,
                                  inject_stall=cfg.inject_stall, placement=self.placement,
                                  seed=derive_seed(cfg.seed, "engine"), wait=False,
                                  lora=engine_lora(cfg),
                                  routed_experts=cfg.algorithm.routing_replay == "rollout")
        self.watchdog.watch("engine", lambda: self.engines.pids)
        if not self.run.trainers_first:
            start_trainers()
        self.engines.wait_ready()

    def _build_components(self, cfg: RLConfig, tokenizer, task, reward, multi_turn,
                          sampler_cls: type[Sampler], host: str) -> None:
        """What uses the workers, each given its dependencies: weight sync, checkpointer,
        engine recovery, sampler, generation log, rollout pipeline."""
        self.kills = InjectedKills(cfg.recovery, self.engines)  # fault injection (tests)
        self.weight_sync = WeightSync(cfg, spec=self.spec, run=self.run, host=host,
                                      actors=self.actors, engines=self.engines,
                                      kills=self.kills)
        self.checkpointer = Checkpointer(self.run_dir, actors=self.actors,
                                         layer_spec=self.run.layer_spec,
                                         inject_error=cfg.checkpoint.inject_error)
        # engines that die are restarted and re-synced; out of restarts, a checkpoint
        self.recovery = EngineRecovery(cfg.recovery, engines=self.engines,
                                       weight_sync=self.weight_sync,
                                       save_checkpoint=self.save_checkpoint,
                                       checkpoint_root=self.checkpointer.root,
                                       keep_last=cfg.checkpoint.keep_last,
                                       restartable=cfg.rollout.partial_chunk_tokens is None)
        self.sampler = sampler_cls(cfg, tokenizer=tokenizer, task=task, reward=reward,
                                   multi_turn=multi_turn, engines=self.engines,
                                   reward_model=self.reward_model, recovery=self.recovery,
                                   kills=self.kills, watchdog=self.watchdog)
        # readable samples of some steps and of every evaluation (rl/evaluation.py)
        self.generation_log = GenerationLog(self.run_dir)
        # one_step / async: the batches generated ahead of training (None: sync)
        self.pipeline = start_pipeline(cfg, self.sampler, self.recovery, self.run.device)

    # --- what the run loop calls ------------------------------------------------------------

    def call_actors(self, method: str, *args, phase: str) -> list:
        return self.actors.call(method, *args, phase=phase)

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's shards into every engine (late engines that are up join
        first); checks each engine got every name. Never under a running generation. An
        engine that died is restarted and synced (rl/recovery.py)."""
        with nullcontext() if self.pipeline is None else self.pipeline.weights_changing():
            self.weight_sync.admit_late_engines()
            try:
                return self.weight_sync.sync_once()
            except (SyncFailed, RolloutError) as err:
                return self.recovery.recover(err, "sync", getattr(err, "engine", None))

    def admit_late_engines(self, wait: bool = False) -> list[int]:
        return self.weight_sync.admit_late_engines(wait=wait)

    def save_checkpoint(self, step: int) -> Path:
        return self.checkpointer.save(step, self.pipeline)

    def load_checkpoint(self, path: Path) -> int:
        return self.checkpointer.load(path, self.pipeline)

    def weights_digests(self) -> list[str]:
        return self.checkpointer.weights_digests()

    def actor_weights(self) -> list[dict[str, torch.Tensor]]:
        return self.checkpointer.actor_weights()

    # --- warm-up ----------------------------------------------------------------------------

    def sft_step(self, batch: Batch) -> dict:
        """One supervised step of the whole actor on `batch` (its mask: the loss mask); the
        global loss and grad norm."""
        rows = {"tokens": batch.tokens, "labels": batch.labels, "loss_mask": batch.mask}
        return self.actors.call_rows("sft_step", rows, phase="warmup")[0]

    def warmup(self, writer: MetricsWriter) -> float:
        """Supervised steps on noisy answers until held-out accuracy is reached (greedy, or
        sampled at `warmup.eval_temperature`)."""
        w = self.cfg.warmup
        acc = 0.0
        for step in range(1, w.max_steps + 1):
            timer = PhaseTimer()
            batch = self.sampler.warmup_batch(step)
            with timer("update_actor"):
                result = self.sft_step(batch)
            metrics = {"loss": result["loss"], "grad_norm": result["grad_norm"]}
            if step % w.eval_every == 0:
                with timer("sync"):
                    self.sync_weights()
                with timer("gen"):
                    acc = self.sampler.accuracy(w.eval_prompts, w.eval_temperature)
                metrics["accuracy"] = acc
                writer.write(step, {**metrics, **timer.as_metrics()})
                if acc >= w.target_accuracy:
                    break
        return acc

    # --- RL ---------------------------------------------------------------------------------

    def reset_optimizer(self) -> None:
        """A fresh RL optimizer on every actor rank (with LoRA at `actor.lora.lr`)."""
        train = self.cfg.actor.lora.rl_train(self.cfg.train)
        self.call_actors("reset_optimizer", train, phase="setup")
        if self.cfg.actor.lora.enabled:  # the actor ranks attach them now if not yet
            self.weight_sync.adapters_attached()

    def rl_step(self, step: int) -> dict[str, float]:
        """One RL step (module doc); its metrics. An engine lost for good in the step's sync
        is raised after the step's metrics are attached to it (the run loop logs them)."""
        cfg, timer = self.cfg, PhaseTimer()
        self.recovery.begin_step(step)
        self.kills.begin_step(step)
        engines = self.engines.num_engines  # in the run as the step starts (late ones join)
        rollouts, gen_timing = self._rollouts_for(step, timer)
        if cfg.rollout.enable_sleep:  # colocated on GPU: free the KV cache while training
            with timer("sleep"):
                self.engines.sleep()
        batch, completions, scores = self._train_batch(rollouts)
        if cfg.logging.generations.due(step):
            self.generation_log.write(step, "train", self.sampler.readable(
                rollouts.examples, rollouts.completions, rollouts.scores,
                cfg.logging.generations.samples))
        trained = trained_tokens(completions, batch.mask)  # raises if the loss has no token
        train_start = time.perf_counter()
        old_logp, is_weights, mismatch, routing = self._old_policy(batch, completions, step,
                                                                   timer)
        extra = self._reference_and_values(batch, timer)
        with timer("adv"):
            groups = torch.arange(len(rollouts.prompt_ids)).repeat_interleave(
                cfg.samples_per_prompt)
            adv, returns, adv_metrics = compute_advantages(cfg.algorithm, scores, groups,
                                                           batch.mask, old_logp, extra)
        updates = self._update_actor(batch, old_logp, adv, extra, is_weights, routing, timer)
        if cfg.algorithm.rollout_correction.mode == "bypass":
            # π_old is the engine's: the first mini-batch's forward, on the weights the engine
            # sampled with, measures the mismatch the skipped pass would have (~0: exact sync)
            mismatch = {"rollout_logprob_max_diff": updates[0]["logp_moved"]}
        critic_updates = self._update_critic(batch, extra, returns, timer)
        self.recovery.step_trained()
        # weights must not change under a running generation: wait for the batches ahead
        overlap = ({} if self.pipeline is None else
                   self.pipeline.quiesce(timer, (train_start, time.perf_counter())))
        if cfg.rollout.enable_sleep:  # the weights only: the sync overwrites them next
            with timer("wake"):
                self.engines.wake_up(["weights"])
        lost = None  # an engine failed past its restarts in the sync: report the step first
        with timer("sync"):
            try:
                sync = self.sync_weights()
            except EngineFailed as failed:
                lost, sync = failed, {}
        if cfg.rollout.enable_sleep:  # mapped after the sync, so the two never hold together
            with timer("wake_kv"):
                self.engines.wake_up(["kv_cache"])
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

    def evaluate(self, step: int) -> dict[str, float]:
        """An evaluation on the held-out prompts with the weights the engines hold (those of
        step `step`; 0: the starting weights): its eval/* metrics and `timing_s/eval`, a few
        of its samples in the generation log. {} when the task has no held-out prompts."""
        if not self.sampler.has_heldout():
            return {}
        start = time.perf_counter()
        metrics, records = self.sampler.evaluate(step, self.cfg.eval,
                                                 self.cfg.logging.generations.samples)
        self.generation_log.write(step, "eval", records)
        return {**metrics, "timing_s/eval": time.perf_counter() - start}

    def _rollouts_for(self, step: int, timer: PhaseTimer) -> tuple[Rollouts, dict[str, float]]:
        """The batch step trains on, and the generation-side metrics to report with it.

        sync: generated now, on the weights synced at the end of the last step. one_step /
        async: generated ahead by the rollout pipeline (`rollout.pipeline`) on weights
        at most `rollout.staleness_bound` updates old; `timing_s/gen_wait` is what the step
        spent blocked on generation."""
        if self.pipeline is None:
            return self.sampler.collect(step, timer), {}
        return self.pipeline.take(step, timer)

    def _train_batch(self, rollouts: Rollouts):
        """(batch, completions, scores): the rollouts as one [n, s] batch, a row per sample,
        and the samples' scores (with DAPO's overlong penalty when configured)."""
        cfg = self.cfg
        outs = rollouts.completions
        flat_prompts = [p for p, o in zip(rollouts.prompt_ids, outs) for _ in o]
        completions = [c for o in outs for c in o]
        scores = torch.tensor([s for group in rollouts.scores for s in group])
        routing = ([c.routing for c in completions]  # the engines' experts (R3)
                   if cfg.algorithm.routing_replay == "rollout" else None)
        batch = build_batch(flat_prompts, [c.token_ids for c in completions],
                            cfg.train.seq_len, self.sampler.tokenizer.pad_token_id,
                            loss_masks(completions), routing)
        if cfg.algorithm.overlong_buffer:
            scores = scores + overlong_penalty(
                batch.mask.sum(-1), max_response_length=cfg.max_new_tokens,
                overlong_buffer=cfg.algorithm.overlong_buffer,
                penalty_factor=cfg.algorithm.overlong_penalty)
        return batch, completions, scores

    def _old_policy(self, batch: Batch, completions, step: int, timer: PhaseTimer):
        """(π_old log-probs, importance weights or None, mismatch metrics, the experts the
        updates replay or None). bypass: the engine's log-probs are π_old; otherwise the
        actor's (a forward pass), compared with the engine's and corrected by
        `algorithm.rollout_correction`. `algorithm.routing_replay`: rollout (R3) replays the
        engines' experts (`batch.routing`) in that pass and the updates; old (R2) records the
        pass's own experts for the updates, so under bypass it runs for them alone."""
        correction = self.cfg.algorithm.rollout_correction
        replay = self.cfg.algorithm.routing_replay
        rollout_logp = engine_logprobs(completions, batch.mask)
        routing = batch.routing if replay == "rollout" else None
        if correction.mode == "bypass" and replay != "old":  # the engine's are the old policy
            return rollout_logp, None, {}, routing
        skip = 0
        with timer("old_logprob"):
            if replay == "old":
                passed, routing = self.actors.logprobs_and_routing(batch, "old_logprob")
            else:
                skip = self._old_logp_rows_from_update(batch.tokens.shape[0])
                rest = Batch(batch.tokens[skip:], batch.labels[skip:], batch.mask[skip:])
                passed = self.actors.per_token("logprobs", rest, "old_logprob",
                                               routing=None if routing is None
                                               else routing[skip:])
        if correction.mode == "bypass":
            return rollout_logp, None, {}, routing
        return (*self._compared_old_policy(passed, completions, batch.mask, rollout_logp, step,
                                           skip), routing)

    def _compared_old_policy(self, passed, completions, mask, rollout_logp, step: int,
                             skip: int):
        """π_old from the actor's pass `passed` (rows skip..), its mismatch with the engine's
        and the rollout correction's weights."""
        correction = self.cfg.algorithm.rollout_correction
        mask = mask[skip:]
        # the first `skip` rows: NaN, the update's own forward (rl_step.PolicyBatch)
        old_logp = torch.cat([torch.full((skip, passed.shape[1]), float("nan")), passed])
        completions = completions[skip:]
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
                extra["ref_logp"] = self.actors.per_token("ref_logprobs", batch, "ref")
        if self.use_critic:
            with timer("values"):
                extra["values"] = self.actors.per_token("values", batch, "values")
        return extra

    def _update_actor(self, batch: Batch, old_logp, adv, extra, is_weights, routing,
                      timer: PhaseTimer) -> list[dict]:
        """The policy update, one call per mini-batch; each call's report. routing: the
        experts every mini-batch replays (`_old_policy`), or None."""
        cfg = self.cfg
        policy = {"tokens": batch.tokens, "labels": batch.labels, "response_mask": batch.mask,
                  "old_logp": old_logp, "advantages": adv}
        if self.use_reference and cfg.algorithm.kl_mode == "loss":
            policy["ref_logp"] = extra["ref_logp"]
        if is_weights is not None:
            policy["is_weights"] = is_weights
        if routing is not None:
            policy["routing"] = routing
        with timer("update_actor"):  # every mini-batch in one call (ActorWorker.update)
            per_rank = self.actors.call_rows("update", policy, cfg.algorithm,
                                             cfg.updates_per_batch, phase="update_actor",
                                             mini_batches=cfg.updates_per_batch)
        return [_global_update_report([rank[k] for rank in per_rank])
                for k in range(cfg.updates_per_batch)]

    def _update_critic(self, batch: Batch, extra, returns, timer: PhaseTimer) -> list[dict]:
        """The critic's value update (GAE only), every mini-batch in one call."""
        if not self.use_critic:
            return []
        value = {"tokens": batch.tokens, "labels": batch.labels, "response_mask": batch.mask,
                 "old_values": extra["values"], "returns": returns}
        with timer("update_critic"):
            return self.actors.call_rows("critic_update", value, self.cfg.algorithm,
                                         self.cfg.updates_per_batch, phase="update_critic",
                                         mini_batches=self.cfg.updates_per_batch)[0]

    def shutdown(self) -> None:
        """Stop workers and engines (a worker stuck in a collective is killed) and remove the
        placement group; then Ray, if this controller started it (`owns_ray`)."""
        if self.pipeline is not None:
            self.pipeline.shutdown()
        self.generation_log.close()
        self._stop_workers()

    def _stop_workers(self, engine_grace_s: float = 30.0) -> None:
        """Every worker started so far stopped and the placement group removed, each step also
        when one before it failed (the error is raised once all have run); then Ray, if this
        controller started it: a Ray that was up already outlives the run, so nothing of the
        run may."""
        with ExitStack() as stops:  # run last-registered first
            if self.owns_ray:
                stops.callback(stop_local_ray)
            if hasattr(self, "placement"):
                stops.callback(self.placement.remove)
            if self.reward_model is not None:
                stops.callback(self.reward_model.shutdown)
            if hasattr(self, "engines"):
                stops.callback(self.engines.shutdown, grace_s=engine_grace_s)
            if hasattr(self, "actors"):
                stops.callback(self.actors.shutdown)


def engine_lora(cfg: RLConfig) -> EngineLoRA | None:
    """What the engines need to serve the actor's adapters (`actor.lora.sync: adapter`)."""
    lora = cfg.actor.lora
    if not lora.syncs_adapters:
        return None
    return EngineLoRA(rank=lora.rank, alpha=lora.alpha)


def _global_update_report(per_rank: list[dict]) -> dict[str, float]:
    """One mini-batch's update report: the global metrics (the same on every rank) and
    logp_moved, the largest of the ranks' own (see rl_step.policy_update)."""
    report = {k: v for k, v in per_rank[0].items()
              if k != "logp_moved_local" and not k.startswith("routing_")}
    moved = [r["logp_moved_local"] for r in per_rank
             if not math.isnan(r["logp_moved_local"])]
    report["logp_moved"] = max(moved, default=float("nan"))
    if "routing_replayed_local" in per_rank[0]:  # counts over every rank's routers
        flips, replayed, seen = (sum(r[f"routing_{k}_local"] for r in per_rank)
                                 for k in ("flips", "replayed", "seen"))
        report["routing/flip_frac"] = flips / max(replayed, 1.0)
        report["routing/replayed_frac"] = replayed / max(seen, 1.0)
    return report


def _update_metrics(updates: list[dict]) -> dict[str, float]:
    """The policy update's report: the last mini-batch's losses (the first's entropy: before
    any update moved the policy) and its sequence packing."""
    last = updates[-1]
    routing = {k: sum(u[k] for u in updates) / len(updates)  # mean over the mini-batches
               for k in ("routing/flip_frac", "routing/replayed_frac") if k in last}
    return {"pg_loss": last["pg_loss"], "clip_frac": last["clip_frac"],
            "ppo_kl": last["ppo_kl"], "entropy": updates[0]["entropy"],
            "grad_norm": last["grad_norm"], "kl_ref": last["kl_ref"], **packing_metrics(last),
            **routing}


__all__ = ["Batch", "RLController", "Rollouts", "SyncFailed", "build_batch", "driver_address"]
