"""Config of a Megatron-Core training step, and the model × grid compatibility check.

`check_model_fits_parallel` is the one place that decides whether a model can be split on a
training grid; the trainer calls it at start-up and a preflight can call it without importing
megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from mcore_rl.config import ConfigError, require_above, require_at_least, require_in_range
from mcore_rl.config.derived import DERIVED, Derived
from mcore_rl.config.dtypes import DtypeName, normalize_dtype_fields
from mcore_rl.config.seeds import USE_THE_RUN_SEED
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig


# The linears of a decoder layer a LoRA adapter can sit on (megatron-core's names): the
# default targets.
LORA_TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# The model's output layer (HF's lm_head), adaptable too: a model whose reward moves through
# its output distribution more than through its layers (a small vocabulary) learns there.
LORA_HEAD = "output_layer"


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters on the actor: the base weights frozen (no gradients, no optimizer state),
    the reference policy the base itself (adapters off; no reference copy of the model).

    rank: the adapters' rank r; 0 (default): off, the whole model trains.
    alpha: the adapters' scale is alpha / rank.
    dropout: dropout on the adapters' input while training.
    targets: the linears adapted in every decoder layer (megatron's names: linear_qkv = HF's
        q/k/v_proj, linear_proj = o_proj, linear_fc1 = gate/up_proj, linear_fc2 = down_proj),
        and `output_layer` (HF's lm_head; untied embeddings only) when named.
    sync: how the engines get the policy. "adapter" (default): the engines run vLLM's LoRA
        and each sync streams the adapters alone, every engine rank receiving them whole (the
        base goes once per sync group when a warm-up or a checkpoint changed it). "merged":
        each training rank merges W + (alpha / rank)·B·A on its own shard and the sync streams
        the merged shards (engines unchanged: for an architecture vLLM serves no LoRA for).
    lr: the RL learning rate with adapters, in place of train.optimizer.lr (a full
        fine-tune's): adapters start at zero and want a larger step (the default is a 1-70B
        model's, as PEFT RL recipes use).
    """

    rank: int = 0
    alpha: float = 32.0
    lr: float = 1e-5
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    sync: Literal["adapter", "merged"] = "adapter"

    def __post_init__(self) -> None:
        require_at_least(self, 0, "rank", note="0: off")
        require_above(self, 0, "alpha", "lr")
        require_in_range(self, 0.0, 1.0, "dropout", high_open=True)
        unknown = [t for t in self.targets if t not in (*LORA_TARGETS, LORA_HEAD)]
        if unknown or not self.targets:
            raise ConfigError("targets", list(self.targets),
                              f"each one of {', '.join((*LORA_TARGETS, LORA_HEAD))} "
                              f"(at least one)")
        if self.sync not in ("adapter", "merged"):
            raise ConfigError("sync", self.sync, "allowed values: adapter, merged")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def syncs_adapters(self) -> bool:
        """The engines serve the adapters through vLLM's LoRA, and weight syncs send them
        alone (`sync: adapter` with LoRA on)."""
        return self.enabled and self.sync == "adapter"

    def rl_train(self, train: "TrainConfig") -> "TrainConfig":
        """The RL trainer config: `train`, with the adapters' learning rate when on."""
        if not self.enabled:
            return train
        return replace(train, optimizer=replace(train.optimizer, lr=self.lr))


@dataclass(frozen=True, kw_only=True)
class ActorConfig(ParallelConfig):
    """The actor: its Megatron grid (ParallelConfig's fields) and what it trains.

    lora: LoRA adapters on the actor's linears, the base frozen (rank 0, the default: off).
    """

    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam (decoupled weight decay, as megatron-core's `adam`) with gradient clipping.

    lr / min_lr: peak and floor learning rate (the default lr, 1e-6, is an RL actor's for a
    1-70B model, as verl's and NeMo-RL's); lr_warmup_steps: linear warm-up from 0 to lr;
    decay: after warm-up, "constant" or "cosine" down to min_lr over decay_steps.
    clip_grad: clip the global gradient norm to this.
    Weight decay skips biases and norms (megatron's default).
    """

    MOVED: ClassVar[dict[str, str]] = {
        "warmup_steps": "set lr_warmup_steps (the learning rate's; `warmup` is the supervised "
                        "warm-up)"}

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    decay: Literal["constant", "cosine"] = "constant"
    decay_steps: int = 1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        require_above(self, 0, "lr")
        require_in_range(self, 0, "lr", "min_lr")
        require_in_range(self, 0, 1, "adam_beta1", "adam_beta2", high_open=True)
        require_at_least(self, 0, "adam_eps", "weight_decay", "lr_warmup_steps")
        # megatron computes the grad norm only while clipping; the step reports it.
        require_above(self, 0, "clip_grad", note="a large value effectively turns clipping off")
        require_at_least(self, 1, "decay_steps")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training step through megatron-core's schedules.

    Per step and data-parallel rank: num_micro_batches micro batches of micro_batch_size
    sequences of seq_len tokens (global batch = dp * num_micro_batches * micro_batch_size).
    The loss is the mean over all loss-masked tokens of the global batch.
    micro_batch_size / seq_len: null = derived by the run that owns this config (an RL run,
    `RLConfig`: seq_len from max_prompt_tokens + max_new_tokens, micro_batch_size from the
    sequences each DP rank gets per update); a standalone step (`train-lm`) needs both set.
    num_micro_batches: `train-lm`'s micro batches per step; an RL run splits each DP rank's
    rows by micro_batch_size instead.
    dtype: "float32", or "bfloat16" (bf16 weights and activations, fp32 main weights, grads
    reduced in fp32); "fp32"/"bf16" are accepted (`mcore_rl.config.dtypes`).
    (megatron's weight init and RNG tracker are seeded by the run's seed, stream "train":
    `setup_trainer(..., seed=derive_seed(seed, "train"))`, `mcore_rl.config.seeds`.)
    recompute: activation recomputation — "none", "selective" (megatron's core-attention
    recompute) or "full" (every layer's activations recomputed in backward, uniform, 1 layer
    per unit); trades compute for memory, same loss and gradients.
    max_tokens_per_micro_batch: None keeps fixed micro batches of micro_batch_size padded rows;
    an int packs the actor/critic passes' rows (first-fit-decreasing on each row's valid length)
    into micro batches of at most this many tokens, one [1, T] row each
    (`mcore_rl.megatron.packing`); micro_batch_size is then unused. >= seq_len, so every row
    fits; with sequence parallelism a multiple of tp.
    forward_micro_batch_size: rows per micro batch of the forward-only passes (old and
    reference log-probs, values) with fixed micro batches; None: micro_batch_size. They keep
    no activations for a backward, so larger micro batches fit and cost fewer schedule
    iterations and TP collectives. Used when it divides the DP rank's rows (with interleaved
    pipelining: into a multiple of pp micro batches), else micro_batch_size is.
    moe_dispatcher: mixture-of-experts token dispatcher, "allgather" or "alltoall".
    moe_aux_loss_coeff: MoE load-balancing aux loss weight; 0 = off (the loss is the LM loss).
    fused_kernels: TransformerEngine's fused RoPE and fused weight-gradient accumulation (into
    the fp32 grad buffers); same maths, fewer passes over memory. overlap_grad_reduce: the DP
    grad reduction runs bucket by bucket during the backward instead of after it. null: the
    run plan's choice (both on GPU, the overlap where dp > 1; off on CPU, where fused kernels
    do not exist); a trainer outside a run (`train-lm`) leaves both off. In an RL config the
    `train` section's values hold for every trainer of the run.
    compile: megatron's SwiGLU and bias-dropout-add fusions, which megatron compiles with
    torch.compile on their first call (one compilation per shape, on every rank). Off
    (default): nothing is compiled. Like the two above, an RL run takes `train`'s value for
    every trainer.
    """

    micro_batch_size: Derived[int] = DERIVED
    num_micro_batches: int = 1
    seq_len: Derived[int] = DERIVED
    dtype: DtypeName = "float32"
    recompute: Literal["none", "selective", "full"] = "none"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    max_tokens_per_micro_batch: int | None = None
    forward_micro_batch_size: int | None = None
    moe_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    moe_aux_loss_coeff: float = 0.0
    fused_kernels: bool | None = None
    overlap_grad_reduce: bool | None = None
    compile: bool = False

    MOVED: ClassVar[dict[str, str]] = {"seed": USE_THE_RUN_SEED.format(stream="train")}

    def __post_init__(self) -> None:
        normalize_dtype_fields(self, "dtype", allowed=("float32", "bfloat16"))
        if self.moe_dispatcher not in ("allgather", "alltoall"):
            raise ConfigError("moe_dispatcher", self.moe_dispatcher, "allgather or alltoall")
        require_at_least(self, 0, "moe_aux_loss_coeff")
        require_at_least(self, 1, "num_micro_batches")
        require_at_least(self, 1, "micro_batch_size", "seq_len", optional=True,
                         problem="must be null (derived) or >= 1")
        require_at_least(self, 1, "forward_micro_batch_size", optional=True,
                         problem="must be null or >= 1")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < (self.seq_len or 1)):
            raise ConfigError("max_tokens_per_micro_batch", budget,
                              f"must be null or an int >= seq_len={self.seq_len} (a whole "
                              "row must fit in one micro batch)")


def check_model_fits_parallel(spec: ModelSpec, parallel: ParallelConfig,
                              train: TrainConfig | None = None, *, grid: str = "actor") -> None:
    """Raise ConfigError (field named as in the YAML: `actor.tp`, ... — `grid` is the key the
    grid has in the config) unless `spec` can be split on `parallel` (and, with `train`, its
    batches fit the grid).

    tp must divide the attention heads, the key-value heads (megatron splits whole query
    groups; replicating kv heads across TP is not supported here) and the FFN width; the
    layers must split over pp (· vpp) stages as `ParallelConfig.stage_layer_counts` says.
    """
    tp = parallel.tp
    try:
        parallel.check_model(spec)
    except ConfigError as err:
        raise err.under(grid) from None
    if train is None:
        return
    if spec.is_moe and tp > 1 and not parallel.sequence_parallel:
        raise ConfigError(f"{grid}.sequence_parallel", False, "training a mixture-of-experts "
                          "model at tp > 1 needs it (megatron-core's MoELayer refuses otherwise)")
    if parallel.sequence_parallel and train.seq_len is not None and train.seq_len % tp:
        raise ConfigError("train.seq_len", train.seq_len,
                          f"sequence_parallel needs it divisible by {grid}.tp={tp}")
    budget = train.max_tokens_per_micro_batch
    if parallel.sequence_parallel and budget is not None and budget % tp:
        raise ConfigError("train.max_tokens_per_micro_batch", budget,
                          f"sequence_parallel needs it divisible by {grid}.tp={tp}")
    if train.seq_len is not None and train.seq_len > spec.max_positions:
        raise ConfigError("train.seq_len", train.seq_len,
                          f"exceeds the model's max_position_embeddings={spec.max_positions}")
    if parallel.vpp is not None and train.num_micro_batches % parallel.pp:
        raise ConfigError("train.num_micro_batches", train.num_micro_batches,
                          f"interleaved pipelining needs a multiple of {grid}.pp={parallel.pp}")
