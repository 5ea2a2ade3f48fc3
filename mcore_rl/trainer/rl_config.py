"""Config of an RL run: the roles' grids and optimizers, rollout, algorithm, task, schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.config import ConfigError
from mcore_rl.parallel import ParallelConfig
from mcore_rl.rollout.engine import RolloutConfig
from mcore_rl.trainer.config import OptimizerConfig, TrainConfig


def load_reward_fn(path: str):
    """"package.module:function" → the function (rule rewards are plain functions)."""
    import importlib

    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError("expected 'package.module:function'")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise ValueError(f"{path} is not callable")
    return fn


@dataclass(frozen=True, kw_only=True)
class DemoModelConfig:
    """The locally built Llama the demo trains (no download): hidden, heads, kv_heads,
    layers, ffn; head_dim = hidden / heads (vLLM's CPU attention needs >= 32)."""

    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    ffn: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.hidden // self.heads < 32:
            raise ConfigError("hidden", self.hidden, f"hidden / heads must be a whole number "
                                                     f">= 32 (vLLM CPU attention), heads={self.heads}")


@dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """Supervised warm-up on noisy labels (each answer digit replaced with probability
    `label_noise`) until greedy accuracy on `eval_prompts` held-out prompts reaches
    `target_accuracy` (checked every `eval_every` steps) or `max_steps` pass."""

    batch_size: int = 64
    label_noise: float = 0.4
    target_accuracy: float = 0.7
    max_steps: int = 1500
    eval_every: int = 50
    eval_prompts: int = 256
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        micro_batch_size=32, num_micro_batches=2, seq_len=11,
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=50, weight_decay=0.01)))

    def __post_init__(self) -> None:
        if not 0 <= self.label_noise < 1:
            raise ConfigError("label_noise", self.label_noise, "must be in [0, 1)")
        if self.max_steps < 0:
            raise ConfigError("max_steps", self.max_steps, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class DeadlineConfig:
    """Seconds each phase may take before the watchdog stops the run (naming the phase, the
    workers that did not arrive, and their stack dumps). startup_s: workers, engines and the
    sync group coming up. gen_s: one generation call. train_s: each actor/critic/reference
    pass (log-probs, values, updates, warm-up steps). sync_s: one weight sync."""

    startup_s: float = 600.0
    gen_s: float = 300.0
    train_s: float = 300.0
    sync_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("startup_s", "gen_s", "train_s", "sync_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")

    def for_phase(self, phase: str) -> float:
        if phase in ("startup", "sync-join", "setup", "shutdown"):
            return self.startup_s
        if phase == "gen":
            return self.gen_s
        if phase == "sync":
            return self.sync_s
        return self.train_s


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """A GRPO-family run on the addition task.

    actor: the actor's Megatron grid. warmup: supervised warm-up (0 max_steps skips it).
    train: the RL optimizer (a fresh one after warm-up) and micro batch size.
    critic_train: the critic's optimizer and micro batch size (advantage_estimator "gae").
    rollout: vLLM engines. algorithm: advantages and loss.
    steps: RL steps. prompts_per_step x samples_per_prompt sequences per step.
    updates_per_batch: optimizer steps (mini-batches x epochs) per generated batch.
    temperature / max_new_tokens: sampling. sync_bucket_mb: weight-sync bucket.
    deadlines: per-phase deadlines of the watchdog.
    inject_stall: fault injection for watchdog tests: "<phase>@rank<r>" stalls actor rank r
        in that phase, "gen@engine<i>" stalls engine i's generation. Leave null.
    save_every: write a checkpoint every this many RL steps (0: never).
    max_sampling_rounds: with algorithm.dynamic_sampling, generation rounds per step at most.
    reward_fn: "module:function" taking (prompt_text, response_text) -> float.
    digits: operand digits of the addition task. seed: prompts and sampling.
    """

    actor: ParallelConfig = field(default_factory=lambda: ParallelConfig(tp=2))
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        micro_batch_size=64, num_micro_batches=1, seq_len=11,
        optimizer=OptimizerConfig(lr=5e-4, clip_grad=1.0)))
    critic_train: TrainConfig = field(default_factory=lambda: TrainConfig(
        micro_batch_size=64, num_micro_batches=1, seq_len=11,
        optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0)))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(
        tp=1, engines=1, max_model_len=64))
    algorithm: AlgorithmConfig = field(default_factory=lambda: AlgorithmConfig(
        clip_eps_low=0.2, clip_eps_high=0.2, clip_c=None, grpo_eps=1e-4))
    model: DemoModelConfig = field(default_factory=DemoModelConfig)
    steps: int = 100
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    updates_per_batch: int = 2
    temperature: float = 1.0
    max_new_tokens: int = 5
    sync_bucket_mb: float = 16.0
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    inject_stall: str | None = None
    save_every: int = 0
    max_sampling_rounds: int = 4
    reward_fn: str = "mcore_rl.tasks.addition:reward"
    digits: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "updates_per_batch",
                     "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        batch = self.prompts_per_step * self.samples_per_prompt
        if batch % self.updates_per_batch:
            raise ConfigError("updates_per_batch", self.updates_per_batch,
                              f"must divide prompts_per_step*samples_per_prompt={batch}")
        per_dp = batch // self.updates_per_batch // self.actor.dp
        if per_dp < 1:
            raise ConfigError("updates_per_batch", self.updates_per_batch,
                              f"leaves no sequences for each of actor.dp={self.actor.dp} ranks")
        try:
            load_reward_fn(self.reward_fn)
        except (ImportError, AttributeError, ValueError) as err:
            raise ConfigError("reward_fn", self.reward_fn, str(err)) from None
        roles = [("train", self.train)]
        if self.algorithm.advantage_estimator == "gae":
            roles.append(("critic_train", self.critic_train))
        for role, train in roles:
            if per_dp % train.micro_batch_size:
                raise ConfigError(f"{role}.micro_batch_size", train.micro_batch_size,
                                  f"must divide the {per_dp} sequences each DP rank gets per "
                                  "update")
        if self.algorithm.kl_mode == "reward" and self.algorithm.kl_coeff and \
                self.algorithm.advantage_estimator in ("grpo", "rloo"):
            raise ConfigError("algorithm.kl_mode", "reward",
                              "group estimators (grpo, rloo) take the KL as a loss term")
        if self.algorithm.loss_agg != "token-mean":
            raise ConfigError("algorithm.loss_agg", self.algorithm.loss_agg,
                              "the Megatron actor update supports token-mean (global token "
                              "normalization through megatron's per-token loss)")
