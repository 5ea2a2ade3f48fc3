"""Config of an RL run: the model, the task, the roles' grids and optimizers, rollout, algorithm,
schedule, and the cluster it is sized for — one YAML that `mcore-rl train`, `mcore-rl preflight`
and `mcore-rl plan-memory` all read."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from mcore_rl.algorithms import AlgorithmConfig
from mcore_rl.config import (
    ConfigError,
    raise_errors,
    require_above,
    require_at_least,
    require_in_range,
    run_checks,
)
from mcore_rl.config.derived import DERIVED, Derived
from mcore_rl.config.seeds import USE_THE_RUN_SEED
from mcore_rl.launch.cluster import ClusterConfig
from mcore_rl.megatron.config import ActorConfig, OptimizerConfig, TrainConfig
from mcore_rl.models.presets import PRESETS
from mcore_rl.models.spec import ModelSpec
from mcore_rl.reward_model import RewardModelConfig
from mcore_rl.rollout.config import RolloutConfig
from mcore_rl.runconfig.sections import (
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    RecoveryConfig,
    SyncConfig,
)
from mcore_rl.tasks.config import TaskConfig

# The demo tokenizer (mcore_rl.tasks.tokenizer, trained on the addition task) has 16 pieces.
DEMO_VOCAB = 16
DEMO_MAX_POSITIONS = 64


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model the run starts from. The rule:

    - hf_dir null: the demo builds a small random Llama locally (no download) from hidden,
      heads, kv_heads, layers, ffn (head_dim = hidden / heads; vLLM's CPU attention
      needs >= 32), with the addition task's tokenizer.
    - hf_dir set: train from that HF checkpoint directory (config.json + safetensors +
      tokenizer); the demo fields are ignored. Preflight sizes the run from hf_dir's
      config.json when the directory is on this machine, else from `preset` (a planner preset
      of the same shapes, `mcore_rl.models.presets`) — so a GPU config is checked on a CPU
      machine without its weights. Preflight warns when both exist and disagree.
    preset: only with hf_dir (see above).
    experts: 0 = the dense demo Llama; > 0 = a demo Qwen3-MoE instead (q/k norms, every layer
      a mixture of `experts` routed experts, `experts_per_token` active per token, each an MLP
      of `expert_ffn`; renormalized top-k). `mcore-rl demo --model moe` sets these.
    Its weights are seeded by the run's seed (stream "model", `mcore_rl.config.seeds`).
    """

    hf_dir: str | None = None
    preset: str | None = None
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    ffn: int = 512
    experts: int = 0
    experts_per_token: int = 2
    expert_ffn: int = 128

    MOVED: ClassVar[dict[str, str]] = {"seed": USE_THE_RUN_SEED.format(stream="model")}

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(
                "preset", self.preset, f"unknown preset; known: {', '.join(sorted(PRESETS))}"
            )
        if self.preset is not None and self.hf_dir is None:
            raise ConfigError(
                "preset",
                self.preset,
                "sizes preflight for an hf_dir checkpoint "
                "that is not on this machine: set hf_dir too",
            )
        if self.hf_dir is not None:
            return
        if self.hidden % self.heads or self.hidden // self.heads < 32:
            raise ConfigError(
                "hidden",
                self.hidden,
                f"hidden / heads must be a whole number "
                f">= 32 (vLLM CPU attention), heads={self.heads}",
            )
        if self.heads % self.kv_heads:
            raise ConfigError("kv_heads", self.kv_heads, f"must divide heads={self.heads}")
        require_at_least(self, 0, "experts", note="0: a dense model")
        if self.experts:
            require_in_range(self, 1, "experts", "experts_per_token")

    def demo_spec(self) -> ModelSpec:
        """Shapes of the locally built demo model (hf_dir null)."""
        dims: dict[str, Any] = dict(
            hidden=self.hidden,
            ffn=self.ffn,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.hidden // self.heads,
            layers=self.layers,
            vocab=DEMO_VOCAB,
            max_positions=DEMO_MAX_POSITIONS,
        )
        if self.experts:
            return ModelSpec(
                family="qwen3_moe",
                architecture="Qwen3MoeForCausalLM",
                **dims,
                qk_norm=True,
                norm_eps=1e-6,
                num_experts=self.experts,
                moe_ffn=self.expert_ffn,
                experts_per_token=self.experts_per_token,
                norm_topk_prob=True,
            )
        return ModelSpec(family="llama", architecture="LlamaForCausalLM", **dims)

    def planning_model(self) -> str | ModelSpec:
        """What preflight sizes from: the demo spec, hf_dir when its config.json is here,
        else the preset. Raises ConfigError when there is nothing to size from."""
        if self.hf_dir is None:
            return self.demo_spec()
        if (Path(self.hf_dir) / "config.json").is_file():
            return self.hf_dir
        if self.preset is not None:
            return self.preset
        raise ConfigError(
            "model.hf_dir",
            self.hf_dir,
            "has no config.json on this machine: set "
            "model.preset to the planner preset of the same shapes "
            f"({', '.join(sorted(PRESETS))}) to check the run without it",
        )

    def context(self) -> tuple[int, str] | None:
        """The model's context in tokens (max_position_embeddings) and where it was read, from
        the model preflight sizes (`planning_model`): hf_dir's config.json when it is here,
        else the preset, the demo model's for the built one. None when none of them is here
        (or hf_dir's config.json does not read: preflight names why)."""
        if self.hf_dir is None:
            return DEMO_MAX_POSITIONS, "the built demo model's max_position_embeddings"
        config = Path(self.hf_dir) / "config.json"
        if config.is_file():
            try:
                return ModelSpec.from_hf_dir(
                    self.hf_dir
                ).max_positions, f"max_position_embeddings in {config}"
            except (OSError, ValueError, KeyError, TypeError):
                return None
        if self.preset is not None:
            return (
                PRESETS[self.preset].max_positions,
                f"max_positions of model.preset={self.preset}",
            )
        return None


@dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """Supervised warm-up on the task's targets, off unless `max_steps` > 0: steps of
    `batch_size` examples (each answer digit replaced with probability `label_noise`) until
    accuracy on `eval_prompts` held-out prompts reaches `target_accuracy` (checked every
    `eval_every` steps) or `max_steps` pass.
    eval_temperature: the temperature of that held-out evaluation (0: greedy). RL learns only
        from groups whose samples differ in reward: a warm-up meant to start RL should stop on
        the accuracy RL will sample (at its `temperature`). Greedy accuracy can be high while
        sampled answers are almost all wrong; a step's gradient then comes from one or two
        rewarded samples, which Adam still turns into a full-size step.
    train: its optimizer and micro batches; seq_len and micro_batch_size null are derived
    (the RL rows' seq_len; the rule of `derived_micro_batch` on batch_size / actor.dp rows).
    """

    batch_size: int = 64
    label_noise: float = 0.0
    target_accuracy: float = 0.7
    eval_temperature: float = 0.0
    max_steps: int = 0
    eval_every: int = 50
    eval_prompts: int = 256
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        require_in_range(self, 0, 1, "label_noise", high_open=True)
        require_at_least(self, 0, "max_steps", "eval_temperature")
        require_at_least(self, 1, "batch_size")


@dataclass(frozen=True, kw_only=True)
class CriticOptimizerConfig(OptimizerConfig):
    """The critic's optimizer: the actor's (`OptimizerConfig`) but for its learning rate.

    lr: peak learning rate; the critic's default, 1e-5, is ten times the actor's: it learns
        faster than the policy (verl's critic lr).
    """

    lr: float = 1e-5


@dataclass(frozen=True, kw_only=True)
class CriticTrainConfig(TrainConfig):
    """The critic's training step: a `TrainConfig` whose optimizer is `CriticOptimizerConfig`.

    optimizer: the critic's optimizer (its own learning rate, see CriticOptimizerConfig).
    """

    optimizer: CriticOptimizerConfig = field(default_factory=CriticOptimizerConfig)


# max_prompt_tokens / max_new_tokens left null are each at most this (a real run's, as
# verl's ppo_trainer.yaml), within the model's context (`RLConfig._derive_lengths`)
LENGTH_DEFAULT = 1024

# A derived micro batch holds at most this many tokens (rows x seq_len; verl's
# ppo_max_token_len_per_gpu default): small rows get one micro batch per update, long ones
# fewer rows per micro batch.
DERIVED_MICRO_BATCH_TOKENS = 16384


def _derived_train(role: str, train: TrainConfig, *, rows: int, seq_len: int) -> TrainConfig:
    """`train` with a null seq_len set to the run's and a null micro_batch_size derived for
    `rows` sequences per DP rank (`derived_micro_batch`); `train` itself when both are set."""
    seq_len = train.seq_len or seq_len
    mbs = train.micro_batch_size or derived_micro_batch(rows, seq_len)
    if (train.seq_len, train.micro_batch_size) == (seq_len, mbs):
        return train
    try:
        return dataclasses.replace(train, seq_len=seq_len, micro_batch_size=mbs)
    except ConfigError as err:
        raise err.under(role) from None


def _sample_words(prompt: int, new: int) -> str:
    return f"max_prompt_tokens + max_new_tokens = {prompt} + {new} = {prompt + new}"


def derived_micro_batch(rows: int, seq_len: int) -> int:
    """The micro batch size a null `micro_batch_size` resolves to: the largest divisor of
    `rows` (the sequences each DP rank gets per update) whose rows hold at most
    DERIVED_MICRO_BATCH_TOKENS tokens; at least 1."""
    cap = max(1, DERIVED_MICRO_BATCH_TOKENS // seq_len)
    return max(d for d in range(1, min(rows, cap) + 1) if rows % d == 0)


@dataclass(frozen=True, kw_only=True)
class DeadlineConfig:
    """Every deadline of a run, in seconds: the watchdog stops a phase that overruns (naming
    the phase, the workers that did not arrive, and their stack dumps), and each wait on a
    worker, engine or store reads its deadline from here.

    startup_s: workers, engines and the sync group coming up (also each rollout engine's own
        start-up wait).
    gen_s: one generation call. train_s: each actor/critic/reference pass (log-probs, values,
        updates, warm-up steps). sync_s: one weight sync.
    engine_call_s: any other rollout-engine call (Ray calls, worker RPCs, joining the sync
        group, probes) that has no phase deadline of its own.
    reward_model_s: the reward model's start-up, each of its `score` calls, and its workers'
        collective timeout.
    """

    startup_s: float = 600.0
    gen_s: float = 300.0
    train_s: float = 300.0
    sync_s: float = 120.0
    engine_call_s: float = 600.0
    reward_model_s: float = 600.0

    def __post_init__(self) -> None:
        require_above(
            self, 0, "startup_s", "gen_s", "train_s", "sync_s", "engine_call_s", "reward_model_s"
        )

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
    """A GRPO-family RL run.

    model: the starting model (HF checkpoint or the built demo model; see ModelConfig).
    task: prompts, reference answers and the rule reward function (see TaskConfig).
    reward_model: an optional HF sequence-classification reward model, scored on its own
        Megatron worker group (reward = rule reward + reward_model.coeff * model score; for
        the model alone, task.reward_fn "mcore_rl.tasks.base:no_reward"). It must share the
        policy's tokenizer.
    cluster: the allocation preflight sizes the run for (default: this machine).
    The defaults are a real run's (a 1-70B model, as verl's ppo_trainer.yaml and NeMo-RL's
    grpo_math_1B.yaml); the demos' small values are written in their YAMLs (configs/).
    actor: the actor's Megatron grid, and LoRA adapters (`actor.lora`).
    warmup: supervised warm-up (off: max_steps 0).
    train: the RL optimizer (a fresh one after warm-up) and micro batch size.
    critic_train: the critic's optimizer and micro batch size (advantage_estimator "gae").
    rollout: vLLM engines. algorithm: advantages and loss.
    steps: RL steps. prompts_per_step x samples_per_prompt sequences per step.
    updates_per_batch: optimizer steps (mini-batches x epochs) per generated batch.
    max_prompt_tokens: the longest prompt, in tokens after tokenization (chat template
        included); a longer one is an error or dropped (task.overlong_prompts). Null: derived
        to fit the model's context (the rule: Lengths below, and the guide's "Lengths").
    max_new_tokens: the longest response (multi-turn: the longest model turn). Null: derived
        to fit the model's context (the rule: Lengths below, and the guide's "Lengths").
    temperature: sampling temperature.
    min_new_tokens: the shortest response of an RL step's samples (EOS cannot end one
        earlier; vLLM's `min_tokens`); 0 = off. Benchmarks use it to fix response lengths
        (`mcore-rl bench step shape=...`). Single-turn, whole-batch generation only.
    Lengths are declared once, here. A sample may hold the model's context
    (max_position_embeddings of model.hf_dir's config.json when it is on this machine, else
    of model.preset, 64 for the built demo model; multi-turn: task.episode.max_total_tokens,
    which must fit that context). max_prompt_tokens / max_new_tokens null are derived to fit
    it, each at most 1024 (`LENGTH_DEFAULT`): one of them set, the other is what the context
    leaves; neither set, each is half the context. Set ones must fit: their sum (multi-turn:
    max_prompt_tokens alone) at most the context, else an error naming them, the numbers and
    the context's source. A context not known here (hf_dir elsewhere, no preset) leaves
    them 1024. The written config holds the derived numbers.
    `sample_tokens` is max_prompt_tokens + max_new_tokens
    (a multi-turn task: task.episode.max_total_tokens). rollout.max_model_len null is
    derived as sample_tokens, train.seq_len null (and warmup's, critic_train's) as
    sample_tokens - 1 (a row holds seq_len + 1 tokens: inputs and the last label; rounded up
    to a multiple of actor.tp under sequence parallelism); an explicit one too small for a
    sample is refused. Micro batch sizes null are derived (`derived_micro_batch`) from the sequences
    each DP rank gets per update. The loaded config holds the resolved values.
    sync: the weight sync's bucket, wire dtype and backend (`SyncConfig`).
    deadlines: per-phase deadlines of the watchdog.
    inject_stall: fault injection for watchdog tests: "<phase>@rank<r>" stalls actor rank r
        in that phase, "gen@engine<i>" stalls engine i's generation. Leave null.
    checkpoint: when checkpoints are written and how many are kept (see CheckpointConfig).
    recovery: restarting rollout engines that die (see RecoveryConfig).
    logging: optional loggers beside TensorBoard (see LoggingConfig): logging.wandb, and
        the readable samples of logging.generations.
    eval: evaluation during RL on the held-out prompts (see EvalConfig).
    max_sampling_rounds: with algorithm.dynamic_sampling, generation rounds per step at most.
    off_policy_steps: deprecated alias of rollout.mode (0: sync, 1: one_step); leave null.
    seed: the run's one seed. Every random stream is hashed from it
        (`derive_seed(seed, stream, *keys)`, `mcore_rl.config.seeds`): each step's prompts and
        each of its samples, the warm-up batches, evaluations, the demo model's weights,
        megatron's init and RNG tracker and vLLM's engine seed.
    """

    MOVED: ClassVar[dict[str, str]] = {
        "sync_bucket_mb": "set sync.bucket_mb",
        "sync_dtype": "set sync.dtype",
    }

    actor: ActorConfig = field(default_factory=ActorConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    critic_train: CriticTrainConfig = field(default_factory=CriticTrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    steps: int = 200
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    updates_per_batch: int = 1
    temperature: float = 1.0
    max_prompt_tokens: Derived[int] = DERIVED
    max_new_tokens: Derived[int] = DERIVED
    min_new_tokens: int = 0
    sync: SyncConfig = field(default_factory=SyncConfig)
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    inject_stall: str | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    max_sampling_rounds: int = 4
    off_policy_steps: int | None = None
    seed: int = 0

    # Derived values: `derived_fields` decides every `null = derived` field, purely, from the
    # config as written; `derived` returns the config with them set (the loader returns that).

    def derived(self) -> RLConfig:
        """This config with every `null = derived` field decided (`derived_fields`); itself
        when nothing is left to derive. A deprecated key it maps warns here, once."""
        if self.off_policy_steps is not None:
            mode = self._rollout_of_off_policy_steps().mode
            warnings.warn(
                f"off_policy_steps={self.off_policy_steps} is deprecated: use rollout.mode={mode}",
                DeprecationWarning,
                stacklevel=2,
            )
        fields = self.derived_fields()
        if all(getattr(self, name) == value for name, value in fields.items()):
            return self
        return dataclasses.replace(self, **fields)

    @property
    def is_derived(self) -> bool:
        """Every `null = derived` field holds its value (and no deprecated key is left to map)."""
        trains = (self.train, self.critic_train, self.warmup.train)
        return (
            self.off_policy_steps is None
            and None not in (self.max_prompt_tokens, self.max_new_tokens)
            and self.rollout.max_model_len is not None
            and all(None not in (t.seq_len, t.micro_batch_size) for t in trains)
        )

    def derived_fields(self) -> dict[str, Any]:
        """The one place the run's derived values are decided: the fields to replace, each
        with its value (an explicit value is kept, and checked against what it must hold).
        Pure: reads this config and the model's context (`ModelConfig.context`); raises
        ConfigError naming a field that cannot hold a sample. The rule: RLConfig's docstring,
        "Lengths"."""
        fields: dict[str, Any] = {}
        rollout = self.rollout
        if self.off_policy_steps is not None:
            rollout = self._rollout_of_off_policy_steps()
            fields["off_policy_steps"] = None
        prompt, new = self._derived_lengths()
        need = self.task.episode.max_total_tokens if self.task.multi_turn else prompt + new
        seq_len = self._derived_seq_len(prompt, new, need)
        max_model_len = self._derived_max_model_len(prompt, new, need)
        if max_model_len != rollout.max_model_len:
            try:
                rollout = dataclasses.replace(rollout, max_model_len=max_model_len)
            except ConfigError as err:
                raise err.under("rollout") from None
        per_dp = self.rows_per_dp
        warm_rows = max(1, self.warmup.batch_size // self.actor.dp)
        warm = _derived_train("warmup.train", self.warmup.train, rows=warm_rows, seq_len=seq_len)
        fields.update(
            max_prompt_tokens=prompt,
            max_new_tokens=new,
            rollout=rollout,
            train=_derived_train("train", self.train, rows=per_dp, seq_len=seq_len),
            critic_train=_derived_train(
                "critic_train", self.critic_train, rows=per_dp, seq_len=seq_len
            ),
            warmup=self.warmup
            if warm is self.warmup.train
            else dataclasses.replace(self.warmup, train=warm),
        )
        return fields

    def _rollout_of_off_policy_steps(self) -> RolloutConfig:
        """rollout with the mode the deprecated `off_policy_steps` names."""
        modes: dict[int, Literal["sync", "one_step"]] = {0: "sync", 1: "one_step"}
        if self.off_policy_steps not in modes:
            raise ConfigError(
                "off_policy_steps",
                self.off_policy_steps,
                "must be 0 or 1 (deprecated: use rollout.mode)",
            )
        mode = modes[self.off_policy_steps]
        if self.rollout.mode not in ("sync", mode):
            raise ConfigError(
                "off_policy_steps",
                self.off_policy_steps,
                f"contradicts rollout.mode={self.rollout.mode}: drop it",
            )
        try:
            return dataclasses.replace(self.rollout, mode=mode)
        except ConfigError as err:
            raise ConfigError("off_policy_steps", self.off_policy_steps, str(err)) from None

    @property
    def wire_dtype(self) -> str:
        """The weight sync's dtype, "float32" or "bfloat16" (sync.dtype resolved)."""
        if self.sync.dtype != "auto":
            return self.sync.dtype
        return "bfloat16" if self.rollout.dtype == "bfloat16" else "float32"

    @property
    def sample_tokens(self) -> int:
        """The most tokens one sample holds: max_prompt_tokens + max_new_tokens, or a
        multi-turn task's task.episode.max_total_tokens (prompt and every turn)."""
        if self.task.multi_turn:
            return self.task.episode.max_total_tokens
        return self.max_prompt_tokens + self.max_new_tokens

    def _derived_lengths(self) -> tuple[int, int]:
        """max_prompt_tokens / max_new_tokens: null ones derived to fit the sample budget
        (`length_budget`), each at most LENGTH_DEFAULT, one of them set leaves the other the
        rest, neither set halves it; set ones are checked against it (single-turn: their sum;
        multi-turn: each alone, a turn is capped by what the episode has left)."""
        total, context = self.task.episode.max_total_tokens, self.model.context()
        if self.task.multi_turn and context is not None and total > context[0]:
            raise ConfigError(
                "task.episode.max_total_tokens",
                total,
                f"an episode must fit the model's context of {context[0]} tokens ({context[1]})",
            )
        prompt, new = self.max_prompt_tokens, self.max_new_tokens
        budget = self.length_budget()
        if budget is None:  # the model's context is not known here
            return prompt or LENGTH_DEFAULT, new or LENGTH_DEFAULT
        room, where = budget
        if prompt is None and new is None:
            return min(LENGTH_DEFAULT, room // 2), min(LENGTH_DEFAULT, room // 2)
        if prompt is None:
            if new >= room:
                raise ConfigError(
                    "max_new_tokens",
                    new,
                    f"leaves no room for a prompt in {where}: set max_new_tokens < {room}",
                )
            return min(LENGTH_DEFAULT, room - new), new
        if new is None:
            if prompt >= room:
                raise ConfigError(
                    "max_prompt_tokens",
                    prompt,
                    f"leaves no room for a response in {where}: set max_prompt_tokens < {room}",
                )
            return prompt, min(LENGTH_DEFAULT, room - prompt)
        if prompt + new > room and not self.task.multi_turn:
            raise ConfigError(
                "max_new_tokens",
                new,
                (
                    f"max_prompt_tokens + max_new_tokens = {prompt} + {new} = {prompt + new} "
                    f"tokens exceed {where}: set max_prompt_tokens + max_new_tokens <= {room}"
                ),
            )
        return prompt, new

    def length_budget(self) -> tuple[int, str] | None:
        """The most tokens one sample may hold, and what says so in words: a multi-turn task's
        task.episode.max_total_tokens, else the model's context (`ModelConfig.context`);
        None when that is not known here."""
        if self.task.multi_turn:
            total = self.task.episode.max_total_tokens
            return total, f"task.episode.max_total_tokens={total}"
        context = self.model.context()
        if context is None:
            return None
        return context[0], f"the model's context of {context[0]} tokens ({context[1]})"

    def _derived_seq_len(self, prompt: int, new: int, need: int) -> int:
        """train.seq_len (the rows of every role): null derived from the `need` tokens of a
        sample, explicit checked against it (multi-turn: `_check_episode_fits`)."""
        if self.task.multi_turn and prompt >= need:
            raise ConfigError(
                "max_prompt_tokens",
                prompt,
                f"must leave room for a model token in task.episode.max_total_tokens={need}",
            )
        seq_len = self.train.seq_len
        if seq_len is None:  # a row holds seq_len + 1 tokens: the inputs and the last label
            tp = self.actor.tp if self.actor.sequence_parallel else 1
            return -(-(need - 1) // tp) * tp
        if seq_len + 1 < need and not self.task.multi_turn:
            raise ConfigError(
                "train.seq_len",
                seq_len,
                f"rows of seq_len + 1 = {seq_len + 1} tokens cannot hold a sample "
                f"of {_sample_words(prompt, new)} tokens: set train.seq_len >= {need - 1} "
                "(or null: derived)",
            )
        return seq_len

    def _derived_max_model_len(self, prompt: int, new: int, need: int) -> int:
        """rollout.max_model_len: null derived as the `need` tokens of a sample, explicit
        checked against it (multi-turn: `_check_episode_fits`)."""
        max_model_len = self.rollout.max_model_len
        if max_model_len is None:
            return need
        if max_model_len < need and not self.task.multi_turn:
            raise ConfigError(
                "rollout.max_model_len",
                max_model_len,
                f"the engines cannot hold a sample of {_sample_words(prompt, new)} tokens: set "
                f"rollout.max_model_len >= {need} (or null: derived)",
            )
        return max_model_len

    def _check_episode_fits(self, derived: dict[str, Any]) -> None:
        """A whole episode must fit the trainer's rows and the engines' context (`derived`:
        the derived fields, `derived_fields`)."""
        total = self.task.episode.max_total_tokens
        for name, limit in (
            ("train.seq_len + 1", derived["train"].seq_len + 1),
            ("rollout.max_model_len", derived["rollout"].max_model_len),
        ):
            if total > limit:
                raise ConfigError(
                    "task.episode.max_total_tokens", total, f"an episode must fit {name}={limit}"
                )
        # later turns send whole contexts: their prefill must not be split over engine steps;
        # until late engines join (rollout.startup_engines), fewer engines share each call
        per_call = -(
            -self.prompts_per_step * self.samples_per_prompt // self.rollout.engines_at_startup
        )
        budget = self.rollout.max_num_batched_tokens
        if budget is None or budget < per_call * total:
            raise ConfigError(
                "rollout.max_num_batched_tokens",
                budget,
                f"a multi-turn turn sends each engine up to {per_call} contexts "
                f"of up to {total} tokens: set >= {per_call * total} (vLLM 0.32 "
                "on CPU fails a seeded prefill split over steps)",
            )

    def _check_partial_rollouts(self) -> None:
        """Partial rollouts continue single-turn samples of one draw; refused with what they
        do not cover (yet): multi-turn episodes and dynamic sampling's redraws."""
        chunk = self.rollout.partial_chunk_tokens
        if chunk is None:
            return
        if self.task.multi_turn:
            raise ConfigError(
                "rollout.partial_chunk_tokens",
                chunk,
                f"partial rollouts are single-turn; task.kind={self.task.kind} is "
                "multi-turn (task.multi_turn): set rollout.partial_chunk_tokens "
                "to null",
            )
        if self.algorithm.dynamic_sampling:
            raise ConfigError(
                "rollout.partial_chunk_tokens",
                chunk,
                "partial rollouts draw each batch once; "
                "algorithm.dynamic_sampling redraws groups: use one or the other",
            )

    def _check_min_new_tokens(self) -> None:
        """min_new_tokens within [0, max_new_tokens], on single-turn whole-batch generation
        (a turn or a partial-rollout chunk has its own, smaller cap)."""
        n = self.min_new_tokens
        if self.max_new_tokens is None:  # not derived: _derive_lengths said why
            return
        require_in_range(self, 0, "max_new_tokens", "min_new_tokens")
        if n and self.task.multi_turn:
            raise ConfigError(
                "min_new_tokens",
                n,
                f"task.kind={self.task.kind} is multi-turn "
                "(a turn's cap is what the episode has left): set 0",
            )
        if n and self.rollout.partial_chunk_tokens is not None:
            raise ConfigError(
                "min_new_tokens",
                n,
                "partial rollouts generate chunks of "
                "rollout.partial_chunk_tokens: set 0 or turn them off",
            )

    # The cross-field checks: each small, independent, raising ConfigError that names its
    # field. __post_init__ runs every one that applies and raises what they found together
    # (`config.run_checks`): `mcore-rl preflight` lists each problem, not the first.

    def _check_counts(self) -> None:
        require_at_least(
            self, 1, "steps", "prompts_per_step", "samples_per_prompt", "updates_per_batch"
        )
        require_at_least(
            self, 1, "max_prompt_tokens", "max_new_tokens", optional=True, note="null: derived"
        )

    def _check_off_policy_steps(self) -> None:
        if self.off_policy_steps is not None:
            self._rollout_of_off_policy_steps()

    @property
    def rows_per_dp(self) -> int:
        """The sequences each actor DP rank gets per update."""
        batch = self.prompts_per_step * self.samples_per_prompt
        return batch // self.updates_per_batch // self.actor.dp

    def _check_batch_split(self) -> None:
        batch = self.prompts_per_step * self.samples_per_prompt
        if batch % self.updates_per_batch:
            raise ConfigError(
                "updates_per_batch",
                self.updates_per_batch,
                f"must divide prompts_per_step*samples_per_prompt={batch}",
            )
        if self.rows_per_dp < 1:
            raise ConfigError(
                "updates_per_batch",
                self.updates_per_batch,
                f"leaves no sequences for each of actor.dp={self.actor.dp} ranks",
            )

    def _check_warmup_targets(self) -> None:
        if self.warmup.max_steps and not self.task.has_targets:
            raise ConfigError(
                "warmup.max_steps",
                self.warmup.max_steps,
                f"task.kind={self.task.kind} has no supervised targets: set 0",
            )

    def _check_demo_model_task(self) -> None:
        if self.model.hf_dir is None and self.task.kind not in ("addition", "tool_calc"):
            raise ConfigError(
                "model.hf_dir",
                None,
                "the built demo model has a synthetic "
                f"task's tokenizer; task.kind={self.task.kind} needs an HF "
                "checkpoint",
            )

    def _check_multi_turn_episode(self, derived: dict[str, Any]) -> None:
        if self.task.multi_turn:
            self._check_episode_fits(derived)

    def _check_colocated_sleep(self) -> None:
        if self.cluster.placement == "colocated" and not self.rollout.enable_sleep:
            raise ConfigError(
                "rollout.enable_sleep",
                False,
                "cluster.placement=colocated "
                "shares every device with the trainer: the engines must sleep",
            )

    def _check_micro_batches(self, derived: dict[str, Any]) -> None:
        per_dp = self.rows_per_dp
        roles = [("train", derived["train"])]
        if self.algorithm.advantage_estimator == "gae":
            roles.append(("critic_train", derived["critic_train"]))
        errors = []
        for role, train in roles:
            # packed micro batches (max_tokens_per_micro_batch) take any number of rows
            if train.max_tokens_per_micro_batch is None and per_dp % train.micro_batch_size:
                errors.append(
                    ConfigError(
                        f"{role}.micro_batch_size",
                        train.micro_batch_size,
                        f"must divide the {per_dp} sequences each DP rank gets per update",
                    )
                )
        raise_errors(errors)

    def _check_kl_in_reward(self) -> None:
        if self.algorithm.kl_in_reward and self.algorithm.advantage_estimator in ("grpo", "rloo"):
            raise ConfigError(
                "algorithm.kl_mode",
                "reward",
                "group estimators (grpo, rloo) take the KL as a loss term",
            )

    # checks of the fields as given; these must pass for the batch split to be checked, and it
    # for the derived values to be decided (`derived_fields` raises what cannot be derived or
    # does not fit)
    BASIC_CHECKS: ClassVar[tuple] = (_check_counts, _check_off_policy_steps)
    # every other check, in the order they are reported; those of the derived values (given
    # them) run once they are decided, the rest whether or not any check above failed
    CHECKS: ClassVar[tuple] = (
        _check_warmup_targets,
        _check_demo_model_task,
        _check_partial_rollouts,
        _check_min_new_tokens,
        _check_multi_turn_episode,
        _check_colocated_sleep,
        _check_micro_batches,
        _check_kl_in_reward,
    )
    SIZED_CHECKS: ClassVar[frozenset] = frozenset({_check_multi_turn_episode, _check_micro_batches})

    def __post_init__(self) -> None:
        """Checks only: the config as written, and the values `derived_fields` decides for it
        (the config itself holds them once `derived` returned it)."""
        errors = run_checks(self, self.BASIC_CHECKS)
        if not errors:
            errors = run_checks(self, [RLConfig._check_batch_split])
        derived = None
        if not errors:
            try:
                derived = self.derived_fields()
            except ConfigError as err:
                errors = getattr(err, "errors", [err])
        checks = [
            check if check not in self.SIZED_CHECKS else functools.partial(check, derived=derived)
            for check in self.CHECKS
            if derived is not None or check not in self.SIZED_CHECKS
        ]
        raise_errors(errors + run_checks(self, checks))
