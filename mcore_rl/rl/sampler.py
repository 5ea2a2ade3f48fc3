"""The controller's generation side: prompts and their sampling, generate calls on the
engines (multi-turn episodes included), scoring, DAPO dynamic sampling, held-out accuracy,
and the batches generated ahead of training (`rollout.mode` one_step / async, partial
rollouts).

`Sampler` is a component of `RLController` (rl/controller.py): it is handed the task, the
tokenizer, the engines, the reward model and the engine recovery it uses.
"""

from __future__ import annotations

import concurrent.futures

from mcore_rl.config.seeds import SAMPLE_BITS, derive_seed
from mcore_rl.launch.timing import PhaseTimer
from mcore_rl.launch.watchdog import Watchdog
from mcore_rl.reward_model import RewardModelGroup, check_reward_model_dir
from mcore_rl.rl.evaluation import eval_metrics
from mcore_rl.rl.recovery import EngineRecovery, InjectedKills
from mcore_rl.rollout.batches import Batch, Rollouts, build_batch
from mcore_rl.rollout.config import vllm_batch_defaults
from mcore_rl.rollout.engine import Completion, RolloutError, SamplingConfig
from mcore_rl.rollout.multi_turn import Episode
from mcore_rl.rollout.partial import PartialBatch, PartialRolloutPipeline, advance
from mcore_rl.rollout.pipeline import RolloutPipeline, on_generation_thread
from mcore_rl.runconfig import RLConfig
from mcore_rl.runconfig.sections import EvalConfig
from mcore_rl.tasks.base import Example, Prompt, RewardFailed, describe_prompt, load_reward_fn
from mcore_rl.tasks.config import DEFAULT_REWARDS
from mcore_rl.tasks.jsonl import JsonlTask
from mcore_rl.tasks.tokenizer import encode_answers, encode_prompts, prompt_texts, response_text


class Sampler:
    """Generating and scoring the batches a run trains on (module doc)."""

    def __init__(self, cfg: RLConfig, *, tokenizer, task, reward, multi_turn, engines,
                 reward_model, recovery: EngineRecovery, kills: InjectedKills,
                 watchdog: Watchdog):
        self.cfg, self.tokenizer, self.task, self.reward = cfg, tokenizer, task, reward
        # multi-turn tasks: episodes with an environment between turns (None: single-turn)
        self.multi_turn = multi_turn
        # held-out accuracy is the task's exact-match reward, whatever reward RL trains on
        self.exact_match = load_reward_fn(DEFAULT_REWARDS[cfg.task.kind])
        self.engines, self.reward_model = engines, reward_model
        self.recovery, self.kills, self.watchdog = recovery, kills, watchdog

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 routing_start: list[int] | None = None):
        """One generate call. An engine that died is restarted and re-synced, and the call
        repeated as it was: same prompts and seeds, so the same samples (rl/recovery.py).
        routing_start: per prompt, the positions whose routed experts the caller holds.
        On the pipeline's generating thread the failure is raised instead: the main thread
        recovers when it waits for the batch (rollout/pipeline.py)."""
        deadline = self.cfg.deadlines.gen_s
        self.kills.inject("gen")
        while True:
            try:
                return self.engines.generate(prompts, sampling, timeout_s=deadline,
                                             routing_start=routing_start)
            except RolloutError as err:
                if "no reply within" in str(err):
                    raise self.watchdog.timeout("gen", deadline, [f"rollout engine {err.engine}"],
                                         str(err)) from err
                if on_generation_thread():
                    raise
                self.recovery.recover(err, "generate", err.engine)

    def encode(self, prompt: Prompt) -> list[int]:
        return self.encode_all([prompt])[0]

    def encode_all(self, prompts: list[Prompt]) -> list[list[int]]:
        """The engines' ids of each prompt (text, or a chat rendered by the tokenizer's chat
        template: `tasks.tokenizer.encode_prompts`), in one tokenizer call. A prompt longer
        than max_prompt_tokens is an error naming it (never cut: the lengths of the trainer's
        rows and the engines' context are derived from max_prompt_tokens)."""
        ids = encode_prompts(self.tokenizer, prompts, chat_template=self.cfg.task.chat_template)
        limit = self.cfg.max_prompt_tokens
        for i, row in enumerate(ids):
            if len(row) > limit:
                raise ValueError(f"prompt {i} of this call ({describe_prompt(prompts[i])}) is "
                                 f"{len(row)} tokens, longer than max_prompt_tokens={limit}: "
                                 "raise max_prompt_tokens")
        return ids

    def _rollout(self, examples: list[Example], sampling: SamplingConfig):
        """(prompt ids, completions per prompt): one generation call, or the episodes of a
        multi-turn task (one batched call per turn, environments between turns)."""
        if self.multi_turn is not None:
            return self.multi_turn.rollout(self.generate, examples, self.encode, sampling)
        prompts = self.encode_all([e.prompt for e in examples])
        return prompts, self.generate(prompts, sampling)

    def accuracy(self, n: int, temperature: float = 0.0) -> float:
        """Exact-match accuracy on n held-out examples, greedy or sampled at `temperature`
        (seeded by the run's seed: the same samples for the same weights); multi-turn: the
        episodes' mean reward, scored by the task's reward function."""
        examples = self.task.heldout_examples(n, seed=derive_seed(self.cfg.seed, "heldout"))
        sampling = SamplingConfig(temperature=temperature, max_tokens=self.cfg.max_new_tokens,
                                  seed=derive_seed(self.cfg.seed, "eval", bits=SAMPLE_BITS)
                                  if temperature else None,
                                  stop_token_ids=[self.tokenizer.eos_token_id])
        _, outs = self._rollout(examples, sampling)
        return sum(o[0].reward if isinstance(o[0], Episode) else
                   self.exact_match(e.prompt, response_text(o[0].token_ids, self.tokenizer),
                                    e.answer) for e, o in zip(examples, outs)) / n

    def has_heldout(self) -> bool:
        """Whether the task has held-out prompts (a jsonl task: task.heldout_path)."""
        return getattr(self.task, "heldout", True) is not None

    def heldout(self, at_most: int) -> list[Example]:
        """The held-out prompts evaluations use: `at_most` of them (a jsonl file's every line
        if it has fewer), the same at every evaluation of the run (stream "heldout")."""
        held = getattr(self.task, "heldout", None)
        n = at_most if held is None else min(at_most, len(held))
        return self.task.heldout_examples(n, seed=derive_seed(self.cfg.seed, "heldout"))

    def evaluate(self, step: int, cfg: EvalConfig, keep: int) -> tuple[dict[str, float],
                                                                       list[dict]]:
        """Evaluation `cfg` on the held-out prompts with the weights the engines hold: its
        metrics (rl/evaluation.py) and `keep` readable samples. Samples are seeded alike at
        every evaluation (stream "eval"), so evaluations differ only by the weights."""
        examples = self.heldout(cfg.max_prompts)
        sampling = SamplingConfig(temperature=cfg.temperature, n=cfg.samples_per_prompt,
                                  max_tokens=self.cfg.max_new_tokens,
                                  seed=derive_seed(self.cfg.seed, "eval", bits=SAMPLE_BITS),
                                  stop_token_ids=[self.tokenizer.eos_token_id])
        prompt_ids, outs = self._rollout(examples, sampling)
        scores, errors = self.score(examples, prompt_ids, outs, step=step, tolerate=True)
        lengths = [[_model_tokens(c) for c in group] for group in outs]
        metrics = eval_metrics(scores, lengths, threshold=cfg.pass_threshold)
        metrics["eval/reward_errors"] = float(errors)
        return metrics, self.readable(examples, outs, scores, keep)

    def readable(self, examples: list[Example], outs: list[list[Completion]],
                 scores: list[list[float]], count: int) -> list[dict]:
        """The first sample of each of the first `count` prompts as a person reads it: the
        prompt text the engines got, the response text the reward got, its reward and the
        reference answer."""
        texts = prompt_texts(self.tokenizer, [e.prompt for e in examples[:count]],
                             chat_template=self.cfg.task.chat_template)
        return [{"prompt": text, "response": response_text(group[0].token_ids, self.tokenizer),
                 "reward": group_scores[0], "answer": e.answer}
                for e, text, group, group_scores in zip(examples, texts, outs, scores)]

    def warmup_batch(self, step: int) -> Batch:
        """Warm-up step `step`'s supervised batch: `warmup.batch_size` prompts with noisy
        answers (`warmup.label_noise`), as [n, s] rows of `warmup.train.seq_len`. Multi-turn:
        whole traces, their observations masked out of the loss."""
        w = self.cfg.warmup
        examples = self.task.warmup_examples(
            w.batch_size, seed=derive_seed(self.cfg.seed, "warmup", step), p=w.label_noise)
        prompts = self.encode_all([p for p, _ in examples])
        if self.multi_turn is None:
            answers, masks = encode_answers(self.tokenizer, [a for _, a in examples]), None
        else:
            answers, masks = zip(*(self.multi_turn.encode_trace(a) for _, a in examples))
        return build_batch(prompts, answers, w.train.seq_len, self.tokenizer.pad_token_id, masks)

    def draw(self, step: int, attempt: int) -> tuple[list[Example], SamplingConfig]:
        """prompts_per_step fresh prompts and their sampling (each seeded by the run's seed,
        the step and the attempt: the data position is the step; mcore_rl/config/seeds.py)."""
        cfg = self.cfg
        examples = self.task.train_examples(cfg.prompts_per_step, step=step, attempt=attempt,
                                            seed=cfg.seed)
        return examples, step_sampling(cfg, step, attempt, self.tokenizer.eos_token_id)

    def _sample(self, step: int, attempt: int):
        """Generate samples_per_prompt responses for `draw`'s prompts; returns (examples,
        their prompt token ids, completions)."""
        examples, sampling = self.draw(step, attempt)
        return examples, *self._rollout(examples, sampling)

    def score(self, examples: list[Example], prompt_ids: list[list[int]],
              outs: list[list[Completion]], *, step: int,
              tolerate: bool = False) -> tuple[list[list[float]], int]:
        """Each sample's reward: the rule function's (prompt, response, answer), plus
        reward_model.coeff times the reward model's score of prompt + response ids. `prompt`
        is the text the engines' ids encode (`tasks.tokenizer.prompt_texts`: a chat's, or
        with task.chat_template a text's, chat template rendering). A rule function that
        raises on a sample: RewardFailed naming it and `step` (task.reward_errors "raise"),
        or the sample scores 0 ("zero"; always with `tolerate`: an evaluation never stops the
        run). Returns the scores and how many samples scored 0 so."""
        texts = (prompt_texts(self.tokenizer, [e.prompt for e in examples],
                              chat_template=self.cfg.task.chat_template)
                 if self.multi_turn is None else [None] * len(examples))
        zero, errors, scores = tolerate or self.cfg.task.reward_errors == "zero", 0, []
        for i, (e, text, group) in enumerate(zip(examples, texts, outs)):
            scores.append([])
            for j, c in enumerate(group):
                if isinstance(c, Episode):  # the environment scored it
                    scores[-1].append(c.reward)
                    continue
                try:
                    scores[-1].append(float(self.reward(
                        text, response_text(c.token_ids, self.tokenizer), e.answer)))
                except Exception as err:
                    if not zero:
                        raise RewardFailed(step=step, prompt_index=i, sample_index=j,
                                           example=e, error=err) from err
                    errors += 1
                    scores[-1].append(0.0)
        if self.reward_model is None:
            return scores, errors
        prompts = [ids for ids, o in zip(prompt_ids, outs) for _ in o]
        responses = [list(c.token_ids) for o in outs for c in o]
        model = self.reward_model.score(prompts, responses, self.tokenizer.pad_token_id).tolist()
        coeff, flat = self.cfg.reward_model.coeff, iter(model)
        return [[s + coeff * next(flat) for s in group] for group in scores], errors

    def _generate_groups(self, step: int, timer: PhaseTimer):
        """The step's groups. With DAPO dynamic sampling, groups whose rewards are all equal
        (no gradient) are dropped and more prompts are drawn — up to `max_sampling_rounds`
        — until prompts_per_step informative groups exist; short of that, dropped groups
        refill the batch (zero advantage) so its shape stays fixed."""
        cfg = self.cfg
        kept, dropped, rounds, errors = [], [], 0, 0
        while len(kept) < cfg.prompts_per_step and rounds < cfg.max_sampling_rounds:
            with timer("gen"):
                examples, prompt_ids, outs = self._sample(step, rounds)
            with timer("reward"):
                scores, failed = self.score(examples, prompt_ids, outs, step=step)
            errors += failed
            rounds += 1
            for group in zip(examples, prompt_ids, outs, scores):
                informative = len(set(group[3])) > 1
                (kept if informative or not cfg.algorithm.dynamic_sampling
                 else dropped).append(group)
            if not cfg.algorithm.dynamic_sampling:
                break
        groups = (kept + dropped)[:cfg.prompts_per_step]
        stats = {"informative_groups_frac": sum(len(set(g[3])) > 1 for g in groups)
                 / len(groups), "sampling_rounds": rounds, "reward/errors": float(errors)}
        return groups, stats

    def collect(self, step: int, timer: PhaseTimer) -> Rollouts:
        """Generate and score the batch of `step` (phases gen and reward on `timer`)."""
        groups, stats = self._generate_groups(step, timer)
        return Rollouts(step=step, examples=[g[0] for g in groups],
                        prompt_ids=[list(g[1]) for g in groups],
                        completions=[list(g[2]) for g in groups],
                        scores=[list(g[3]) for g in groups], stats=stats)

    def wait_in_flight(self, future):
        """future.result under a deadline beyond the generation's own (which names the late
        engine): this one catches a wedged reward function."""
        deadline = self.cfg.deadlines.gen_s * self.cfg.max_sampling_rounds + 60.0
        try:
            return future.result(timeout=deadline)
        except concurrent.futures.TimeoutError:
            raise self.watchdog.timeout("gen", deadline,
                                        ["the rollout pipeline's generation thread"],
                                 "generation + reward of a batch ahead did not finish") from None


def _model_tokens(c: Completion) -> int:
    """A response's tokens the model generated (an episode's observations excluded)."""
    return c.model_tokens if isinstance(c, Episode) else len(c.token_ids)


def step_sampling(cfg: RLConfig, step: int, attempt: int, eos_id: int) -> SamplingConfig:
    """How RL step `step` samples its draw `attempt`: the call's seed is hashed from the run's
    seed, the step and the attempt, and each sample's from that, its prompt's index and its
    own (`SamplingConfig.sample_seed`): no two samples of a run share a seed."""
    return SamplingConfig(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                          min_tokens=cfg.min_new_tokens, n=cfg.samples_per_prompt,
                          seed=derive_seed(cfg.seed, "sample", step, attempt, bits=SAMPLE_BITS),
                          stop_token_ids=[eos_id])


def fit_prompts(cfg: RLConfig, task, tokenizer) -> dict[str, float]:
    """A jsonl task's prompts against max_prompt_tokens, tokenized once as the engines get
    them: task.overlong_prompts "error" stops the run naming the first longer one (file,
    line, tokens), "filter" drops them. Returns the step metrics that report it
    (`prompts/filtered_overlong`: training rows dropped; `..._heldout`: held-out rows)."""
    if not isinstance(task, JsonlTask):  # generated prompts: checked as encoded
        return {"prompts/filtered_overlong": 0.0}
    dropped = task.fit_prompts(
        lambda texts: [len(ids) for ids in encode_prompts(
            tokenizer, texts, chat_template=cfg.task.chat_template)],
        cfg.max_prompt_tokens, drop=cfg.task.overlong_prompts == "filter")
    metrics = {"prompts/filtered_overlong": float(dropped.get("train", 0))}
    if "heldout" in dropped:
        metrics["prompts/filtered_overlong_heldout"] = float(dropped["heldout"])
    return metrics


def start_reward_model(cfg: RLConfig, tokenizer, *, host: str, stack_dir, placement, run):
    """The reward model's worker group (None without one). It scores the policy's token
    ids, so its vocabulary must cover the policy tokenizer's."""
    rm = cfg.reward_model
    if not rm.enabled:
        return None

    vocab = check_reward_model_dir(rm.hf_dir).vocab
    if vocab < len(tokenizer):
        raise ValueError(f"reward_model.hf_dir={rm.hf_dir}: vocabulary of {vocab} tokens "
                         f"does not cover the policy tokenizer's {len(tokenizer)}; the "
                         "reward model must share the policy's tokenizer")
    return RewardModelGroup(rm, timeout_s=cfg.deadlines.reward_model_s, host=host,
                            stack_dir=stack_dir, placement=placement,
                            devices=run.actor_devices, layer_spec=run.layer_spec)


def start_pipeline(cfg: RLConfig, sampler: Sampler, recovery: EngineRecovery, device: str):
    """one_step / async: the pipeline that generates batches ahead (None in sync mode)."""
    if cfg.rollout.partial_chunk_tokens is not None:  # generations span weight syncs
        return partial_pipeline(cfg, sampler, device)
    if cfg.rollout.mode == "sync":
        return None

    def recover_lost_batch(err: RolloutError) -> int:
        """A batch ahead lost with an engine: restart it and sync the actor's weights
        (rl/recovery.py); the weight version the engines then hold."""
        recovery.recover(err, "generate", err.engine)
        return recovery.actor_version()

    return RolloutPipeline(sampler.collect, max_staleness=cfg.rollout.staleness_bound,
                           last_step=cfg.steps, wait=sampler.wait_in_flight,
                           recover=recover_lost_batch, deterministic=cfg.rollout.deterministic)


def partial_pipeline(cfg: RLConfig, sampler: Sampler, device: str) -> PartialRolloutPipeline:
    """The pipeline of a run with partial rollouts: prompts and seeds as the sampler draws
    them (`draw`), generation through its engines under its deadline, rewards by its
    `score`."""
    budget = cfg.rollout.max_num_batched_tokens or vllm_batch_defaults(
        device, 0.0, cfg.rollout.tp)[0]

    def start(step: int):
        examples, sampling = sampler.draw(step, 0)
        prompts = sampler.encode_all([e.prompt for e in examples])
        return examples, PartialBatch.start(prompts, sampling)

    def advance_on(batch: PartialBatch, version: int, max_tokens: int | None) -> None:
        advance(batch, sampler.generate, version=version, max_tokens=max_tokens,
                max_model_len=cfg.rollout.max_model_len, token_budget=budget,
                engines=cfg.rollout.engines)

    def finish(step: int, examples, batch: PartialBatch, timer: PhaseTimer):
        outs = batch.completions()
        with timer("reward"):
            scores, errors = sampler.score(examples, batch.prompt_ids, outs, step=step)
        stats = {"informative_groups_frac": sum(len(set(s)) > 1 for s in scores) / len(scores),
                 "sampling_rounds": 1, "reward/errors": float(errors)}
        return Rollouts(step=step, examples=list(examples), prompt_ids=batch.prompt_ids,
                        completions=outs, scores=scores, stats=stats)

    return PartialRolloutPipeline(
        start=start, advance=advance_on, finish=finish,
        chunk_tokens=cfg.rollout.partial_chunk_tokens,
        max_staleness=cfg.rollout.staleness_bound, last_step=cfg.steps,
        wait=sampler.wait_in_flight,
        examples_to_state=lambda examples: [e.to_state() for e in examples],
        examples_from_state=lambda saved: [Example.from_state(e) for e in saved])


__all__ = ["Sampler", "fit_prompts", "partial_pipeline", "start_pipeline",
           "start_reward_model", "step_sampling"]
