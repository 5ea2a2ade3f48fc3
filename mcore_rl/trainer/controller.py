"""The single controller of an RL run (GRPO family) on the addition task.

It owns the data flow and the clock; workers own the compute. Per step:
generate (vLLM engines) → reward (rule function) → old log-probs (Megatron actor) →
advantages → policy update (mini-batches) → weight sync (streamed shards, timed as its own
phase, never billed to the actor). Every remote wait has a deadline; a phase that misses it
ends the run with a `WatchdogTimeout` naming the phase, the workers that did not arrive, and
the stack dumps every worker wrote (mcore_rl/launch/watchdog.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.algorithms import (AlgorithmConfig, gae_advantages, grpo_advantages,
                                 kl_penalty_rewards, outcome_to_token_rewards, overlong_penalty,
                                 reinforce_pp_advantages, rloo_advantages)
from mcore_rl.launch.watchdog import WatchdogTimeout, collect_or_name_dead, dump_stacks
from mcore_rl.layouts import megatron_shards, vllm_shards
from mcore_rl.models.spec import ModelSpec
from mcore_rl.planning.resolve import resolve_run
from mcore_rl.resharding import SyncGroupSpec, build_plan, host_store
from mcore_rl.rollout.engine import Completion, RolloutError, SamplingConfig
from mcore_rl.tasks.base import Example, load_reward_fn
from mcore_rl.tasks.config import DEFAULT_REWARDS, build_reward, build_task
from mcore_rl.tasks.tokenizer import encode_answer, encode_prompt, load_tokenizer, response_text
from mcore_rl.trainer import checkpoint_store
from mcore_rl.trainer.config import DTYPES
from mcore_rl.trainer.metrics import MetricsWriter, PhaseTimer
from mcore_rl.trainer.rl_config import RLConfig


class SyncFailed(RuntimeError):
    """A weight sync failed; names the engines that died."""


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def driver_address() -> str:
    """The address this controller's stores listen on: MCORE_RL_NODE_IP (set per node by the
    SLURM launcher) or loopback — never all interfaces."""
    return os.environ.get("MCORE_RL_NODE_IP", "127.0.0.1")


@dataclass
class Rollouts:
    """One step's generated groups: per prompt its example, its token ids, its samples and
    their rewards; `stats` are the sampling statistics (dynamic sampling). Plain values, so
    an off-policy batch in flight can be saved with a checkpoint (`to_state` /
    `from_state`)."""

    step: int
    examples: list[Example]
    prompt_ids: list[list[int]]
    completions: list[list[Completion]]
    scores: list[list[float]]
    stats: dict[str, float]

    def to_state(self) -> dict:
        return {"step": self.step, "prompts": [e.prompt for e in self.examples],
                "answers": [e.answer for e in self.examples], "scores": self.scores,
                "prompt_ids": self.prompt_ids,
                "stats": self.stats,
                "completions": [[{"token_ids": list(c.token_ids), "logprobs": list(c.logprobs),
                                  "finish_reason": c.finish_reason} for c in group]
                                for group in self.completions]}

    @classmethod
    def from_state(cls, state: dict) -> "Rollouts":
        completions = [[Completion(tuple(c["token_ids"]), tuple(c["logprobs"]),
                                   c["finish_reason"]) for c in group]
                       for group in state["completions"]]
        examples = [Example(p, a) for p, a in zip(state["prompts"], state["answers"])]
        return cls(step=state["step"], examples=examples, prompt_ids=state["prompt_ids"],
                   completions=completions,
                   scores=state["scores"], stats=state["stats"])


@dataclass
class Batch:
    """Sequences [n, s] as the actor sees them: tokens (inputs), labels (next tokens), and the
    response mask aligned with labels."""

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor


def build_batch(prompts: list[list[int]], responses: list[list[int]], length: int,
                pad_id: int) -> Batch:
    """Concatenate prompt + response ids, pad to `length` + 1 tokens, shift into
    (tokens, labels); the mask marks the labels that are response tokens."""
    rows, masks = [], []
    for prompt, response in zip(prompts, responses):
        seq = (list(prompt) + list(response))[:length + 1]
        pad = length + 1 - len(seq)
        rows.append(seq + [pad_id] * pad)
        mask = [0] * (len(prompt) - 1) + [1] * (len(seq) - len(prompt)) + [0] * pad
        masks.append(mask[:length])
    full = torch.tensor(rows, dtype=torch.long)
    return Batch(full[:, :-1].contiguous(), full[:, 1:].contiguous(),
                 torch.tensor(masks, dtype=torch.float32))


def _mini_batches(batch: dict[str, torch.Tensor], count: int):
    """`count` equal, contiguous mini-batches of the rows."""
    n = next(iter(batch.values())).shape[0] // count
    for k in range(count):
        yield {key: value[k * n:(k + 1) * n] for key, value in batch.items()}


def compute_advantages(algo: AlgorithmConfig, scores: torch.Tensor, groups: torch.Tensor,
                       mask: torch.Tensor, old_logp: torch.Tensor,
                       extra: dict[str, torch.Tensor]):
    """Advantages [n, s] (and returns, for the critic) by the configured estimator.

    Group estimators (grpo, rloo) use the sequence scores; token estimators (gae,
    reinforce_pp) use token rewards: the score on the last response token, minus the KL to
    the reference on every token when kl_mode is "reward"."""
    metrics: dict[str, float] = {}
    if algo.advantage_estimator == "grpo":
        return grpo_advantages(scores, groups, mask, norm_by_std=algo.grpo_norm_by_std,
                               eps=algo.grpo_eps), None, metrics
    if algo.advantage_estimator == "rloo":
        return rloo_advantages(scores, groups, mask), None, metrics
    token_rewards = outcome_to_token_rewards(scores, mask)
    if algo.kl_coeff and algo.kl_mode == "reward":
        token_rewards, kl = kl_penalty_rewards(token_rewards, old_logp, extra["ref_logp"], mask,
                                               coeff=algo.kl_coeff, estimator=algo.kl_estimator)
        metrics["kl_reward"] = float(kl["kl"])
    if algo.advantage_estimator == "gae":
        adv, returns = gae_advantages(token_rewards, extra["values"], mask, gamma=algo.gamma,
                                      lam=algo.lam)
        return adv, returns, metrics
    adv, returns = reinforce_pp_advantages(token_rewards, mask, gamma=algo.gamma)
    return adv, returns, metrics


_PACKING = ("pack_efficiency", "pad_efficiency", "micro_batches")


def _packing_metrics(update: dict) -> dict[str, float]:
    """The actor update's sequence packing (real tokens / tokens run), when it packs."""
    return {key: update[key] for key in _PACKING if key in update}


def _critic_metrics(critic_updates: list[dict]) -> dict[str, float]:
    if not critic_updates:
        return {}
    return {k: v for k, v in critic_updates[-1].items() if k not in _PACKING}


def _rollout_logprob_diff(completions, actor_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Max |vLLM log-prob − actor log-prob| over all sampled response tokens."""
    worst = 0.0
    for row, completion in enumerate(completions):
        positions = mask[row].nonzero().flatten()
        n = min(len(positions), len(completion.logprobs))
        if n:
            engine = torch.tensor(completion.logprobs[:n])
            worst = max(worst, float((engine - actor_logp[row, positions[:n]]).abs().max()))
    return worst


class RLController:
    """Owns the Ray workers (actor ranks, rollout engines), the sync plan and the loop."""

    def __init__(self, cfg: RLConfig, model_dir: Path, run_dir: Path):
        import ray

        from mcore_rl.launch.placement import RayPlacement
        from mcore_rl.rollout.ray_engines import RayEngines, init_local_ray
        from mcore_rl.trainer.actor_worker import ActorWorker

        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.spec = ModelSpec.from_hf_dir(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.task = build_task(cfg.task)
        self.reward = build_reward(cfg.task)
        # held-out accuracy is the task's exact-match reward, whatever reward RL trains on
        self.exact_match = load_reward_fn(DEFAULT_REWARDS[cfg.task.kind])
        init_local_ray(num_cpus=max(2, os.cpu_count() or 2))
        world = cfg.actor.world_size
        # The actor world meets at a store the controller hosts (not on whichever node rank 0
        # lands), so no worker needs to know another node's address.
        self.host = driver_address()
        self._actor_store = host_store(self.host, world_size=world + 1,
                                       timeout_s=cfg.deadlines.startup_s)
        # every device, backend and transport choice of the run, decided once
        self.run = resolve_run(cfg)
        self.placement = RayPlacement(self.run.placement,
                                      cpus_per_engine=cfg.rollout.cpus_per_engine,
                                      gpu=self.run.device == "cuda",
                                      timeout_s=cfg.deadlines.startup_s)
        actor_slots = self.placement.plan.actor
        remote_cls = ray.remote(num_cpus=0)(ActorWorker)
        self.use_critic = cfg.algorithm.advantage_estimator == "gae"
        self.use_reference = cfg.algorithm.kl_coeff > 0
        self.stack_dir = self.run_dir / "stacks"
        self.workers = [remote_cls.options(
            **self.placement.options_for_node(actor_slots[rank].node)).remote(
            rank, world, (self.host, self._actor_store.port), self.spec, cfg.actor,
            cfg.warmup.train, str(model_dir),
            cfg.deadlines.train_s, critic_train=cfg.critic_train if self.use_critic else None,
            reference=self.use_reference, stack_dir=str(self.stack_dir),
            inject_stall=cfg.inject_stall, device=actor_slots[rank].device)
            for rank in range(world)]
        self.worker_pids = self._actor("pid", phase="startup")
        self.reward_model = self._start_reward_model()
        self.engines = RayEngines(model_dir, cfg.rollout, stack_dir=self.stack_dir,
                                  inject_stall=cfg.inject_stall, placement=self.placement)
        self._join_sync_group()
        self._in_flight = None  # one-step off-policy: the next step's batch being generated
        self._executor = None
        self.plan = build_plan(megatron_shards(self.spec, cfg.actor),
                               vllm_shards(self.spec, cfg.rollout.tp, cfg.rollout.engines),
                               bucket_bytes=int(cfg.sync_bucket_mb * (1 << 20)),
                               element_size=DTYPES[cfg.wire_dtype].itemsize)

    # --- plumbing ---------------------------------------------------------------------------

    def _wait(self, refs: list, phase: str) -> list:
        """ray.get under the phase's deadline; past it, the watchdog names who is late."""
        import ray

        deadline = self.cfg.deadlines.for_phase(phase)
        # results as they arrive: a rank that died fails the phase at once, by name, rather
        # than after its peers' collective timeout
        values = collect_or_name_dead(refs, deadline, phase,
                                      getattr(self, "worker_pids", None))
        if len(values) < len(refs):
            late = [f"actor rank {i}" for i in range(len(refs)) if i not in values]
            raise self._watchdog(phase, deadline, late)
        return [values[i] for i in range(len(refs))]

    def _watchdog(self, phase: str, deadline: float, late: list[str],
                  detail: str = "") -> WatchdogTimeout:
        """Every worker (actor ranks and engines) dumps its stacks; the error names the phase,
        the late workers and the dump files."""
        pids = {f"rank{i}": pid for i, pid in enumerate(getattr(self, "worker_pids", []))}
        if getattr(self, "reward_model", None) is not None:
            pids.update({f"reward_rank{i}": pid for i, pid in enumerate(self.reward_model.pids)})
        if hasattr(self, "engines"):
            pids.update({f"engine{i}": pid for i, pid in enumerate(self.engines.pids)})
        return WatchdogTimeout(phase, deadline, late, dump_stacks(pids, self.stack_dir),
                               detail)

    def _actor(self, method: str, *args, phase: str) -> list:
        return self._wait([getattr(w, method).remote(*args) for w in self.workers], phase)

    def _join_sync_group(self) -> None:
        world = self.cfg.actor.world_size + self.cfg.rollout.tp * self.cfg.rollout.engines
        self._store = host_store(self.host, world_size=world,
                                 timeout_s=self.cfg.deadlines.startup_s)
        spec = SyncGroupSpec(self.host, self._store.port, "sync/", world,
                             self.cfg.deadlines.sync_s)
        self.engines.start_join_sync_group(spec, self.cfg.actor.world_size)
        self._actor("join_sync_group", spec, phase="sync-join")
        self.engines.finish_join_sync_group()

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's shards into every engine; checks each engine got every name."""
        if self._in_flight is not None:  # never change weights under a running generation
            self._wait_in_flight(self._in_flight)
        self.engines.begin_sync(self.plan, dtype=DTYPES[self.cfg.wire_dtype],
                                timeout_s=self.cfg.deadlines.sync_s)
        return self._finish_sync()

    def _finish_sync(self) -> dict[str, float]:
        """The trainer side of a started sync. A failure is blamed on the engines that died,
        by name, when there are any (a bare transport error only says a peer left)."""
        try:
            stats = self._actor("send_weights", self.plan, self.cfg.wire_dtype,
                                self.cfg.deadlines.sync_s,
                                phase="sync")
            self.engines.finish_sync()
        except WatchdogTimeout:
            raise
        except Exception as err:
            dead = self.engines.dead_engines()
            if dead:
                raise SyncFailed(f"weight sync failed: rollout engine(s) {dead} died or stopped "
                                 f"answering during the sync ({type(err).__name__}: "
                                 f"{_first_line(err)})") from err
            raise
        return {"sync_bytes": float(sum(s["bytes_sent"] for s in stats))}

    def _per_token(self, method: str, batch: Batch, phase: str) -> torch.Tensor:
        """A forward-only pass on every worker; one [n, s] result, assembled over DP. The
        response mask tells packed passes where each row's real tokens end."""
        outs = self._actor(method, batch.tokens, batch.labels, batch.mask, phase=phase)
        slots = self._wait([w.dp_rank_of_output.remote() for w in self.workers], phase)
        by_dp = {dp: out for dp, out in zip(slots, outs) if dp is not None}
        return torch.cat([by_dp[d] for d in range(self.cfg.actor.dp)])

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig):
        deadline = self.cfg.deadlines.gen_s
        try:
            return self.engines.generate(prompts, sampling, timeout_s=deadline)
        except RolloutError as err:
            if "no reply within" not in str(err):
                raise
            raise self._watchdog("gen", deadline, [f"rollout engine {err.engine}"],
                                 str(err)) from err

    # --- warm-up ----------------------------------------------------------------------------

    def encode(self, prompt_text: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt_text,
                             chat_template=self.cfg.task.chat_template)

    def accuracy(self, n: int) -> float:
        """Greedy exact-match accuracy on n held-out examples."""
        examples = self.task.heldout_examples(n, seed=self.cfg.seed)
        sampling = SamplingConfig(temperature=0.0, max_tokens=self.cfg.max_new_tokens,
                                  stop_token_ids=[self.tokenizer.eos_token_id])
        outs = self._generate([self.encode(e.prompt) for e in examples], sampling)
        return sum(self.exact_match(e.prompt, response_text(o[0].token_ids, self.tokenizer),
                                    e.answer) for e, o in zip(examples, outs)) / n

    def warmup(self, writer: MetricsWriter) -> float:
        """Supervised steps on noisy answers until held-out greedy accuracy is reached."""
        w = self.cfg.warmup
        acc = 0.0
        for step in range(1, w.max_steps + 1):
            timer = PhaseTimer()
            examples = self.task.warmup_examples(w.batch_size, seed=self.cfg.seed * 100003 + step,
                                                 p=w.label_noise)
            prompts = [self.encode(p) for p, _ in examples]
            answers = [encode_answer(self.tokenizer, a) for _, a in examples]
            batch = build_batch(prompts, answers, w.train.seq_len, self.tokenizer.pad_token_id)
            with timer("update_actor"):
                result = self._actor("sft_step", batch.tokens, batch.labels, batch.mask,
                                     phase="warmup")[0]
            metrics = {"loss": result["loss"], "grad_norm": result["grad_norm"]}
            if step % w.eval_every == 0:
                with timer("sync"):
                    self.sync_weights()
                with timer("gen"):
                    acc = self.accuracy(w.eval_prompts)
                metrics["accuracy"] = acc
                writer.write(step, {**metrics, **timer.as_metrics()})
                if acc >= w.target_accuracy:
                    break
        return acc

    # --- RL ---------------------------------------------------------------------------------

    def reset_optimizer(self) -> None:
        self._actor("reset_optimizer", self.cfg.train, phase="setup")

    def _sample(self, step: int, attempt: int):
        """Generate samples_per_prompt responses for prompts_per_step fresh prompts (seeded by
        step and attempt: the data position is the step); returns (examples, their prompt
        token ids, completions)."""
        cfg = self.cfg
        examples = self.task.train_examples(cfg.prompts_per_step, step=step, attempt=attempt,
                                            seed=cfg.seed)
        prompts = [self.encode(e.prompt) for e in examples]
        sampling = SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                                  n=cfg.samples_per_prompt,
                                  seed=cfg.seed * 1000 + step + 1_000_003 * attempt,
                                  stop_token_ids=[self.tokenizer.eos_token_id])
        return examples, prompts, self._generate(prompts, sampling)

    def score(self, examples: list[Example], prompt_ids: list[list[int]],
              outs: list[list[Completion]]) -> list[list[float]]:
        """Each sample's reward: the rule function's (prompt, response, answer), plus
        reward_model.coeff times the reward model's score of prompt + response ids."""
        scores = [[float(self.reward(e.prompt, response_text(c.token_ids, self.tokenizer),
                                     e.answer)) for c in o] for e, o in zip(examples, outs)]
        if self.reward_model is None:
            return scores
        prompts = [ids for ids, o in zip(prompt_ids, outs) for _ in o]
        responses = [list(c.token_ids) for o in outs for c in o]
        model = self.reward_model.score(prompts, responses, self.tokenizer.pad_token_id).tolist()
        coeff, flat = self.cfg.reward_model.coeff, iter(model)
        return [[s + coeff * next(flat) for s in group] for group in scores]

    def _start_reward_model(self):
        """The reward model's worker group (None without one). It scores the policy's token
        ids, so its vocabulary must cover the policy tokenizer's."""
        rm = self.cfg.reward_model
        if not rm.enabled:
            return None
        from mcore_rl.trainer.reward_model import RewardModelGroup, check_reward_model_dir

        vocab = check_reward_model_dir(rm.hf_dir).vocab
        if vocab < len(self.tokenizer):
            raise ValueError(f"reward_model.hf_dir={rm.hf_dir}: vocabulary of {vocab} tokens "
                             f"does not cover the policy tokenizer's {len(self.tokenizer)}; the "
                             "reward model must share the policy's tokenizer")
        return RewardModelGroup(rm, host=self.host, stack_dir=self.stack_dir,
                                placement=self.placement)

    def _generate_groups(self, step: int, timer: PhaseTimer):
        """The step's groups. With DAPO dynamic sampling, groups whose rewards are all equal
        (no gradient) are dropped and more prompts are drawn — up to `max_sampling_rounds`
        — until prompts_per_step informative groups exist; short of that, dropped groups
        refill the batch (zero advantage) so its shape stays fixed."""
        cfg = self.cfg
        kept, dropped, rounds = [], [], 0
        while len(kept) < cfg.prompts_per_step and rounds < cfg.max_sampling_rounds:
            with timer("gen"):
                examples, prompt_ids, outs = self._sample(step, rounds)
            with timer("reward"):
                scores = self.score(examples, prompt_ids, outs)
            rounds += 1
            for group in zip(examples, prompt_ids, outs, scores):
                informative = len(set(group[3])) > 1
                (kept if informative or not cfg.algorithm.dynamic_sampling
                 else dropped).append(group)
            if not cfg.algorithm.dynamic_sampling:
                break
        groups = (kept + dropped)[:cfg.prompts_per_step]
        stats = {"informative_groups_frac": sum(len(set(g[3])) > 1 for g in groups)
                 / len(groups), "sampling_rounds": rounds}
        return groups, stats

    def collect(self, step: int, timer: PhaseTimer) -> Rollouts:
        """Generate and score the batch of `step` (phases gen and reward on `timer`)."""
        groups, stats = self._generate_groups(step, timer)
        return Rollouts(step=step, examples=[g[0] for g in groups],
                        prompt_ids=[list(g[1]) for g in groups],
                        completions=[list(g[2]) for g in groups],
                        scores=[list(g[3]) for g in groups], stats=stats)

    def _rollouts_for(self, step: int, timer: PhaseTimer) -> tuple[Rollouts, dict[str, float]]:
        """The batch step trains on, and the generation-side timings to report with it.

        On-policy: generated now, on the weights synced at the end of the last step.
        One-step off-policy: generated during the previous step's training (on the weights
        before that step's update); this step starts generating the next batch before it
        trains, and `timing_s/gen_wait` is what it spent blocked on generation."""
        if not self.cfg.off_policy_steps:
            return self.collect(step, timer), {}
        if self._in_flight is None:  # first step, or just resumed without a saved batch
            self._start_collect(step)
        with timer("gen_wait"):
            rollouts, gen_timing, _ = self._take_in_flight()
        if rollouts.step != step:
            raise RuntimeError(f"off-policy batch of step {rollouts.step} offered to step {step}")
        if step < self.cfg.steps:
            self._start_collect(step + 1)
        return rollouts, gen_timing

    def _start_collect(self, step: int) -> None:
        import concurrent.futures

        def run():
            timer, start = PhaseTimer(), time.perf_counter()
            rollouts = self.collect(step, timer)
            timing = {k: v for k, v in timer.as_metrics().items() if k != "timing_s/step"}
            return rollouts, timing, (start, time.perf_counter())

        if self._executor is None:  # one thread: generation runs beside the actor's work
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "mcore-rl-gen")
        self._in_flight = self._executor.submit(run)

    def _take_in_flight(self):
        """The in-flight generation's (rollouts, timings, wall window); its errors (e.g. a
        WatchdogTimeout) re-raise here."""
        future, self._in_flight = self._in_flight, None
        return self._wait_in_flight(future)

    def _wait_in_flight(self, future):
        """future.result under a deadline beyond the generation's own (which names the late
        engine): this one catches a wedged reward function."""
        import concurrent.futures

        deadline = self.cfg.deadlines.gen_s * self.cfg.max_sampling_rounds + 60.0
        try:
            return future.result(timeout=deadline)
        except concurrent.futures.TimeoutError:
            raise self._watchdog("gen", deadline, ["the off-policy generation thread"],
                                 "generation + reward of the next batch did not finish") from None

    def _quiesce_generation(self, timer: PhaseTimer, train_window: tuple[float, float]
                            ) -> dict[str, float]:
        """Weights must not change under a running generation: before a sync, wait for the
        in-flight batch (it stays in flight for the next step to take). Returns how many
        seconds of its generation ran while this step trained (`gen_overlap_s`)."""
        if self._in_flight is None:
            return {}
        if not self._in_flight.done():
            with timer("gen_wait"):
                self._wait_in_flight(self._in_flight)
        _, _, (gen_start, gen_end) = self._in_flight.result()
        overlap = min(gen_end, train_window[1]) - max(gen_start, train_window[0])
        return {"gen_overlap_s": max(overlap, 0.0)}

    def rl_step(self, step: int) -> dict[str, float]:
        cfg, timer = self.cfg, PhaseTimer()
        rollouts, gen_timing = self._rollouts_for(step, timer)
        if cfg.rollout.enable_sleep:  # colocated on GPU: free the KV cache while training
            with timer("sleep"):
                self.engines.sleep()
        prompts = rollouts.prompt_ids
        outs = rollouts.completions
        flat_prompts = [p for p, o in zip(prompts, outs) for _ in o]
        completions = [c for o in outs for c in o]
        scores = torch.tensor([s for group in rollouts.scores for s in group])
        batch = build_batch(flat_prompts, [c.token_ids for c in completions],
                            cfg.train.seq_len, self.tokenizer.pad_token_id)
        lengths = batch.mask.sum(-1)
        if cfg.algorithm.overlong_buffer:
            scores = scores + overlong_penalty(
                lengths, max_response_length=cfg.max_new_tokens,
                overlong_buffer=cfg.algorithm.overlong_buffer,
                penalty_factor=cfg.algorithm.overlong_penalty)
        train_start = time.perf_counter()
        with timer("old_logprob"):
            old_logp = self._per_token("logprobs", batch, "old_logprob")
        rollout_diff = _rollout_logprob_diff(completions, old_logp, batch.mask)
        extra: dict[str, torch.Tensor] = {}
        if self.use_reference:
            with timer("ref"):
                extra["ref_logp"] = self._per_token("ref_logprobs", batch, "ref")
        if self.use_critic:
            with timer("values"):
                extra["values"] = self._per_token("values", batch, "values")
        with timer("adv"):
            groups = torch.arange(len(prompts)).repeat_interleave(cfg.samples_per_prompt)
            adv, returns, adv_metrics = compute_advantages(cfg.algorithm, scores, groups,
                                                           batch.mask, old_logp, extra)
        policy = {"tokens": batch.tokens, "labels": batch.labels, "response_mask": batch.mask,
                  "old_logp": old_logp, "advantages": adv}
        if self.use_reference and cfg.algorithm.kl_mode == "loss":
            policy["ref_logp"] = extra["ref_logp"]
        updates, critic_updates = [], []
        with timer("update_actor"):
            for mini in _mini_batches(policy, cfg.updates_per_batch):
                updates.append(self._actor("update", mini, cfg.algorithm,
                                           phase="update_actor")[0])
        if self.use_critic:
            value = {"tokens": batch.tokens, "labels": batch.labels,
                     "response_mask": batch.mask, "old_values": extra["values"],
                     "returns": returns}
            with timer("update_critic"):
                for mini in _mini_batches(value, cfg.updates_per_batch):
                    critic_updates.append(self._actor("critic_update", mini, cfg.algorithm,
                                                      phase="update_critic")[0])
        overlap = self._quiesce_generation(timer, (train_start, time.perf_counter()))
        if cfg.rollout.enable_sleep:
            with timer("wake"):
                self.engines.wake_up()
        with timer("sync"):
            sync = self.sync_weights()
        gen_tokens = float(batch.mask.sum())
        metrics = {
            "reward_mean": float(scores.mean()), "reward_std": float(scores.std()),
            "response_length": gen_tokens / len(completions),
            "pg_loss": updates[-1]["pg_loss"], "clip_frac": updates[-1]["clip_frac"],
            "ppo_kl": updates[-1]["ppo_kl"], "entropy": updates[0]["entropy"],
            "grad_norm": updates[-1]["grad_norm"],
            # vLLM's log-probs of its samples vs the actor's on the same (synced) weights:
            # ~0 means the weight sync is exact; it grows if the engine serves stale weights
            # (and off-policy it measures the one-step staleness)
            "rollout_logprob_max_diff": rollout_diff,
            "kl_ref": updates[-1]["kl_ref"], **adv_metrics,
            **_critic_metrics(critic_updates), **_packing_metrics(updates[-1]),
            **sync, **rollouts.stats, **timer.as_metrics(), **gen_timing, **overlap,
        }
        metrics["tokens_per_s"] = gen_tokens / max(metrics["timing_s/gen"], 1e-9)
        return metrics

    # --- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        """RUN_DIR/checkpoints/step_<k>: every rank writes into a temporary directory, which is
        renamed when all are done and only then marked complete (trainer/checkpoint_store.py);
        a save that cannot write raises CheckpointWriteError naming the path."""
        root = self.run_dir / "checkpoints"
        final = root / f"step_{step}"
        tmp = root / f".step_{step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        with checkpoint_store.writing(root, tmp, step, self.cfg.checkpoint.inject_error):
            self._actor("save_checkpoint", str(tmp), phase="save")
            if self._in_flight is not None:
                # off-policy: the next batch was generated on weights this checkpoint no longer
                # holds; saved with it, a resumed run trains on exactly the same batch
                rollouts, timing, _ = self._wait_in_flight(self._in_flight)
                torch.save({"rollouts": rollouts.to_state(), "timing": timing},
                           tmp / "next_rollouts.pt")
            (tmp / "controller.json").write_text(json.dumps({"step": step}))
        return checkpoint_store.publish(tmp, final, step)

    def load_checkpoint(self, path: Path) -> int:
        """Restore every role from a checkpoint (a complete one: `path` or, for a run's
        checkpoints root, its newest); returns the step it was taken after. The data position
        is the step: prompts and sampling seeds derive from it."""
        path = checkpoint_store.resolve_checkpoint(Path(path))
        meta = path / "controller.json"
        if not meta.is_file():
            raise FileNotFoundError(f"{path}: not a checkpoint (no controller.json)")
        self._actor("load_checkpoint", str(path), phase="load")
        self._in_flight = None
        if self.cfg.off_policy_steps and (path / "next_rollouts.pt").is_file():
            import concurrent.futures

            saved = torch.load(path / "next_rollouts.pt", weights_only=True)
            self._in_flight = concurrent.futures.Future()
            self._in_flight.set_result((Rollouts.from_state(saved["rollouts"]),
                                        saved["timing"], (0.0, 0.0)))
        return int(json.loads(meta.read_text())["step"])

    def weights_digests(self) -> list[str]:
        return self._actor("weights_digest", phase="save")

    def shutdown(self) -> None:
        """Stop workers and engines; a worker stuck in a collective is killed with Ray."""
        import ray

        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        try:
            ray.wait([w.shutdown.remote() for w in self.workers],
                     num_returns=len(self.workers), timeout=10.0)
            self.engines.shutdown()
            if self.reward_model is not None:
                self.reward_model.shutdown()
            self.placement.remove()
        finally:
            ray.shutdown()
