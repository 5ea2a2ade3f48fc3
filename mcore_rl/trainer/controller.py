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

from mcore_rl.config.seeds import derive_seed
from mcore_rl.algorithms import (AlgorithmConfig, correction_weights, gae_advantages,
                                 grpo_advantages, kl_penalty_rewards, outcome_to_token_rewards,
                                 overlong_penalty, reinforce_pp_advantages, rloo_advantages)
from mcore_rl.launch.watchdog import WatchdogTimeout, collect_or_name_dead, dump_stacks
from mcore_rl.layouts import megatron_shards, vllm_shards
from mcore_rl.models.spec import ModelSpec
from mcore_rl.planning.resolve import resolve_run
from mcore_rl.resharding import build_plan, host_store, sync_group_spec
from mcore_rl.rollout.engine import Completion, RolloutError, SamplingConfig
from mcore_rl.rollout.multi_turn import (Episode, build_multi_turn, completion_from_state,
                                         completion_state, episode_metrics, loss_masks)
from mcore_rl.tasks.base import Example, load_reward_fn
from mcore_rl.tasks.config import DEFAULT_REWARDS, build_reward, build_task
from mcore_rl.tasks.tokenizer import encode_answer, encode_prompt, load_tokenizer, response_text
from mcore_rl.trainer import checkpoint_store
from mcore_rl.config.dtypes import torch_dtype
from mcore_rl.trainer.metrics import MetricsWriter, PhaseTimer
from mcore_rl.trainer.partial_rollout import current_version_logprob_diff
from mcore_rl.trainer.recovery import EngineFailed, EngineRecovery
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
                "completions": [[completion_state(c) for c in group]
                                for group in self.completions]}

    @classmethod
    def from_state(cls, state: dict) -> "Rollouts":
        completions = [[completion_from_state(c) for c in group]
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
                pad_id: int, response_masks: list[list[int]] | None = None) -> Batch:
    """Concatenate prompt + response ids, pad to `length` + 1 tokens, shift into
    (tokens, labels); the mask marks the labels that are response tokens — of those, with
    `response_masks` (one per response, per token: multi-turn episodes), only the ones it
    marks 1 (model tokens; observation tokens stay 0)."""
    rows, masks = [], []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        seq = (list(prompt) + list(response))[:length + 1]
        pad = length + 1 - len(seq)
        rows.append(seq + [pad_id] * pad)
        kept = [1] * len(response) if response_masks is None else list(response_masks[i])
        mask = [0] * (len(prompt) - 1) + kept[:len(seq) - len(prompt)] + [0] * pad
        masks.append(mask[:length])
    full = torch.tensor(rows, dtype=torch.long)
    return Batch(full[:, :-1].contiguous(), full[:, 1:].contiguous(),
                 torch.tensor(masks, dtype=torch.float32))


def engine_logprobs(completions: list[Completion], mask: torch.Tensor) -> torch.Tensor:
    """The engine's log-prob of each sampled token, [n, s] aligned with `build_batch`'s
    response mask (0 elsewhere): π_rollout of the rollout correction and of `bypass`."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    for row, completion in enumerate(completions):
        positions = mask[row].nonzero().flatten()
        if len(completion.logprobs) < len(positions):
            raise ValueError(f"sample {row}: the engine returned {len(completion.logprobs)} "
                             f"log-probs for {len(positions)} response tokens")
        out[row, positions] = torch.tensor(completion.logprobs[:len(positions)])
    return out


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
        # multi-turn tasks: episodes with an environment between turns (None: single-turn)
        self.multi_turn = build_multi_turn(cfg.task, self.tokenizer, self.reward)
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
            inject_stall=cfg.inject_stall, device=actor_slots[rank].device,
            layer_spec=self.run.layer_spec, seed=derive_seed(cfg.seed, "train"))
            for rank in range(world)]
        self.worker_pids = self._actor("pid", phase="startup")
        self.reward_model = self._start_reward_model()
        self.engines = RayEngines(model_dir, cfg.rollout,
                                  start_timeout_s=cfg.deadlines.startup_s,
                                  call_timeout_s=cfg.deadlines.engine_call_s,
                                  stack_dir=self.stack_dir,
                                  inject_stall=cfg.inject_stall, placement=self.placement)
        self.recovery = EngineRecovery(self, cfg.recovery)  # engines that die are restarted
        self._sync_groups_formed = 0
        self._join_sync_group()
        self.pipeline = None  # one_step / async: the batches generated ahead of training
        if cfg.rollout.partial_chunk_tokens is not None:  # generations span weight syncs
            from mcore_rl.trainer.partial_rollout import partial_pipeline

            self.pipeline = partial_pipeline(self)
        elif cfg.rollout.mode != "sync":
            from mcore_rl.trainer.async_rollout import RolloutPipeline

            self.pipeline = RolloutPipeline(self.collect,
                                            max_staleness=cfg.rollout.staleness_bound,
                                            last_step=cfg.steps, wait=self._wait_in_flight)
        self.plan = build_plan(megatron_shards(self.spec, cfg.actor,
                                               layer_spec=self.run.layer_spec),
                               vllm_shards(self.spec, cfg.rollout.tp, cfg.rollout.engines),
                               bucket_bytes=int(cfg.sync_bucket_mb * (1 << 20)),
                               element_size=torch_dtype(cfg.wire_dtype).itemsize)

    # --- plumbing ---------------------------------------------------------------------------

    def _wait(self, refs: list, phase: str) -> list:
        """The workers' results under the phase's deadline; past it, the watchdog names who is
        late (a worker that died is named at once)."""
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
        """Form the sync group (again after an engine restart: a new store and prefix)."""
        world = self.cfg.actor.world_size + self.cfg.rollout.tp * self.cfg.rollout.engines
        self._store = host_store(self.host, world_size=world,
                                 timeout_s=self.cfg.deadlines.startup_s)
        spec = sync_group_spec(self.run, host=self.host, port=self._store.port,
                               prefix=f"sync/{self._sync_groups_formed}/",
                               timeout_s=self.cfg.deadlines.sync_s)
        self._sync_groups_formed += 1
        self.engines.start_join_sync_group(spec, self.cfg.actor.world_size,
                                           devices=self.run.engine_devices)
        self._wait([w.join_sync_group.remote(spec, self.run.actor_devices[rank])
                    for rank, w in enumerate(self.workers)], "sync-join")
        self.engines.finish_join_sync_group()

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's shards into every engine; checks each engine got every name.
        An engine that died is restarted and synced (trainer/recovery.py)."""
        if self.pipeline is not None:  # never change weights under a running generation
            self.pipeline.quiesce()
        try:
            return self._sync_once()
        except (SyncFailed, RolloutError) as err:
            return self.recovery.recover(err, "sync", getattr(err, "engine", None))

    def _sync_once(self) -> dict[str, float]:
        self.engines.begin_sync(self.plan, dtype=torch_dtype(self.cfg.wire_dtype),
                                timeout_s=self.cfg.deadlines.sync_s)
        self.recovery.inject("sync")
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
        return {"sync_bytes": float(sum(s["bytes_sent"] for s in stats)),
                "sync_bytes_ipc": float(sum(s.get("bytes_sent_ipc", 0) for s in stats))}

    def _per_token(self, method: str, batch: Batch, phase: str) -> torch.Tensor:
        """A forward-only pass on every worker; one [n, s] result, assembled over DP. The
        response mask tells packed passes where each row's real tokens end."""
        outs = self._actor(method, batch.tokens, batch.labels, batch.mask, phase=phase)
        if not hasattr(self, "_output_slots"):  # fixed by the grid: asked once per run
            self._output_slots = self._wait([w.dp_rank_of_output.remote()
                                             for w in self.workers], phase)
        by_dp = {dp: out for dp, out in zip(self._output_slots, outs) if dp is not None}
        return torch.cat([by_dp[d] for d in range(self.cfg.actor.dp)])

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig):
        """One generate call. An engine that died is restarted and re-synced, and the call
        repeated as it was: same prompts and seeds, so the same samples (trainer/recovery.py)."""
        deadline = self.cfg.deadlines.gen_s
        self.recovery.inject("gen")
        while True:
            try:
                return self.engines.generate(prompts, sampling, timeout_s=deadline)
            except RolloutError as err:
                if "no reply within" in str(err):
                    raise self._watchdog("gen", deadline, [f"rollout engine {err.engine}"],
                                         str(err)) from err
                self.recovery.recover(err, "generate", err.engine)

    # --- warm-up ----------------------------------------------------------------------------

    def encode(self, prompt_text: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt_text,
                             chat_template=self.cfg.task.chat_template)

    def _rollout(self, examples: list[Example], sampling: SamplingConfig):
        """(prompt ids, completions per prompt): one generation call, or the episodes of a
        multi-turn task (one batched call per turn, environments between turns)."""
        if self.multi_turn is not None:
            return self.multi_turn.rollout(self._generate, examples, self.encode, sampling)
        prompts = [self.encode(e.prompt) for e in examples]
        return prompts, self._generate(prompts, sampling)

    def accuracy(self, n: int) -> float:
        """Greedy exact-match accuracy on n held-out examples (multi-turn: the greedy
        episodes' mean reward, scored by the task's reward function)."""
        examples = self.task.heldout_examples(n, seed=self.cfg.seed)
        sampling = SamplingConfig(temperature=0.0, max_tokens=self.cfg.max_new_tokens,
                                  stop_token_ids=[self.tokenizer.eos_token_id])
        _, outs = self._rollout(examples, sampling)
        return sum(o[0].reward if isinstance(o[0], Episode) else
                   self.exact_match(e.prompt, response_text(o[0].token_ids, self.tokenizer),
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
            if self.multi_turn is None:
                answers, masks = [encode_answer(self.tokenizer, a) for _, a in examples], None
            else:  # whole traces; their observations are masked out of the loss
                answers, masks = zip(*(self.multi_turn.encode_trace(a) for _, a in examples))
            batch = build_batch(prompts, answers, w.train.seq_len, self.tokenizer.pad_token_id,
                                masks)
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

    def _draw(self, step: int, attempt: int) -> tuple[list[Example], SamplingConfig]:
        """prompts_per_step fresh prompts and their sampling (seeded by step and attempt: the
        data position is the step)."""
        cfg = self.cfg
        examples = self.task.train_examples(cfg.prompts_per_step, step=step, attempt=attempt,
                                            seed=cfg.seed)
        sampling = SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                                  n=cfg.samples_per_prompt,
                                  seed=cfg.seed * 1000 + step + 1_000_003 * attempt,
                                  stop_token_ids=[self.tokenizer.eos_token_id])
        return examples, sampling

    def _sample(self, step: int, attempt: int):
        """Generate samples_per_prompt responses for `_draw`'s prompts; returns (examples,
        their prompt token ids, completions)."""
        examples, sampling = self._draw(step, attempt)
        return examples, *self._rollout(examples, sampling)

    def score(self, examples: list[Example], prompt_ids: list[list[int]],
              outs: list[list[Completion]]) -> list[list[float]]:
        """Each sample's reward: the rule function's (prompt, response, answer), plus
        reward_model.coeff times the reward model's score of prompt + response ids."""
        scores = [[c.reward if isinstance(c, Episode) else  # the environment scored it
                   float(self.reward(e.prompt, response_text(c.token_ids, self.tokenizer),
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
        from mcore_rl.reward_model import RewardModelGroup, check_reward_model_dir

        vocab = check_reward_model_dir(rm.hf_dir).vocab
        if vocab < len(self.tokenizer):
            raise ValueError(f"reward_model.hf_dir={rm.hf_dir}: vocabulary of {vocab} tokens "
                             f"does not cover the policy tokenizer's {len(self.tokenizer)}; the "
                             "reward model must share the policy's tokenizer")
        return RewardModelGroup(rm, timeout_s=self.cfg.deadlines.reward_model_s,
                                host=self.host, stack_dir=self.stack_dir,
                                placement=self.placement, layer_spec=self.run.layer_spec)

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
        """The batch step trains on, and the generation-side metrics to report with it.

        sync: generated now, on the weights synced at the end of the last step. one_step /
        async: generated ahead by the rollout pipeline (`trainer.async_rollout`) on weights
        at most `rollout.staleness_bound` updates old; `timing_s/gen_wait` is what the step
        spent blocked on generation."""
        if self.pipeline is None:
            return self.collect(step, timer), {}
        return self.pipeline.take(step, timer)

    def _wait_in_flight(self, future):
        """future.result under a deadline beyond the generation's own (which names the late
        engine): this one catches a wedged reward function."""
        import concurrent.futures

        deadline = self.cfg.deadlines.gen_s * self.cfg.max_sampling_rounds + 60.0
        try:
            return future.result(timeout=deadline)
        except concurrent.futures.TimeoutError:
            raise self._watchdog("gen", deadline, ["the rollout pipeline's generation thread"],
                                 "generation + reward of a batch ahead did not finish") from None

    def rl_step(self, step: int) -> dict[str, float]:
        cfg, timer = self.cfg, PhaseTimer()
        self.recovery.begin_step(step)
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
                            cfg.train.seq_len, self.tokenizer.pad_token_id,
                            loss_masks(completions))
        lengths = batch.mask.sum(-1)
        if cfg.algorithm.overlong_buffer:
            scores = scores + overlong_penalty(
                lengths, max_response_length=cfg.max_new_tokens,
                overlong_buffer=cfg.algorithm.overlong_buffer,
                penalty_factor=cfg.algorithm.overlong_penalty)
        train_start = time.perf_counter()
        correction = cfg.algorithm.rollout_correction
        rollout_logp = engine_logprobs(completions, batch.mask)
        mismatch: dict[str, float] = {}
        if correction.mode == "bypass":  # the engine's log-probs are the old policy
            old_logp, is_weights = rollout_logp, None
        else:
            with timer("old_logprob"):
                old_logp = self._per_token("logprobs", batch, "old_logprob")
            # vLLM's log-probs of its samples vs the actor's on the same (synced) weights:
            # ~0 means the weight sync is exact; it grows if the engine serves stale weights
            # (and off-policy it measures the staleness)
            mismatch["rollout_logprob_max_diff"] = _rollout_logprob_diff(
                completions, old_logp, batch.mask)
            # partial rollouts: the tokens generated on these very weights must match exactly
            mismatch.update(current_version_logprob_diff(completions, old_logp, batch.mask,
                                                         version=step - 1))
            is_weights, correction_metrics = correction_weights(correction, old_logp,
                                                                rollout_logp, batch.mask)
            mismatch.update(correction_metrics)
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
        if is_weights is not None:
            policy["is_weights"] = is_weights
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
        gen_tokens = float(batch.mask.sum())
        metrics = {
            "reward_mean": float(scores.mean()), "reward_std": float(scores.std()),
            "response_length": gen_tokens / len(completions),
            "pg_loss": updates[-1]["pg_loss"], "clip_frac": updates[-1]["clip_frac"],
            "ppo_kl": updates[-1]["ppo_kl"], "entropy": updates[0]["entropy"],
            "grad_norm": updates[-1]["grad_norm"], **mismatch,
            "kl_ref": updates[-1]["kl_ref"], **adv_metrics,
            **_critic_metrics(critic_updates), **_packing_metrics(updates[-1]),
            **sync, **rollouts.stats, **timer.as_metrics(), **gen_timing, **overlap,
            **episode_metrics(completions), **self.recovery.metrics(),
        }
        metrics["tokens_per_s"] = gen_tokens / max(metrics["timing_s/gen"], 1e-9)
        if lost is not None:
            lost.step_metrics = metrics
            raise lost
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
            if self.pipeline is not None:
                # the batches ahead were generated on weights this checkpoint no longer holds;
                # saved with it (and their versions), a resumed run trains on exactly them
                torch.save(self.pipeline.state(), tmp / "rollout_buffer.pt")
            (tmp / "controller.json").write_text(json.dumps({"step": step,
                                                             "layer_spec": self.run.layer_spec}))
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
        if self.pipeline is not None and (path / "rollout_buffer.pt").is_file():
            self.pipeline.load_state(torch.load(path / "rollout_buffer.pt", weights_only=True),
                                     Rollouts.from_state)
        return int(json.loads(meta.read_text())["step"])

    def weights_digests(self) -> list[str]:
        return self._actor("weights_digest", phase="save")

    def actor_weights(self) -> list[dict[str, torch.Tensor]]:
        """Each actor rank's parameters (megatron_shards keys): `trainer.hf_export`."""
        return self._actor("export_weights", phase="save")

    def shutdown(self) -> None:
        """Stop workers and engines; a worker stuck in a collective is killed with Ray."""
        import ray

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
            ray.shutdown()
