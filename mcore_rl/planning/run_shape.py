"""`RunShape`: the shape of a whole RL run — model, grids, batch, rollout engines, placement and
hardware — as far as the memory planner and the preflight checks need it.

It holds shapes only (no learning rates, no paths to data). It is the planner's internal
input: users write one run config (`mcore_rl.trainer.rl_config.RLConfig`), which
`mcore_rl.trainer.preflight.run_shape_of` maps onto a RunShape for `mcore-rl plan-memory`,
`mcore-rl preflight` and the automatic preflight of `mcore-rl train` (and which renames the
fields in their messages back to the RLConfig's). Field names follow the component configs
they describe (`ParallelConfig` as is; `TrainShape` ~ `trainer.config.TrainConfig`;
`RolloutShape` ~ `rollout.engine.RolloutConfig`).

Each dataclass checks its own fields (ranges, allowed values). Whether the fields agree with
each other and with the hardware (TP vs heads, world sizes vs GPUs, backends) is for
`mcore_rl.planning.preflight`, which lists every problem at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mcore_rl.config import ConfigError
from mcore_rl.models.presets import PRESETS
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig

GiB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class TrainShape:
    """The training roles: the actor, and optionally a critic and a reference model on the same
    devices and the same grid (`parallel`).

    micro_batch_size: sequences per micro batch. global_batch_size: sequences per optimizer
        step (over all DP ranks); micro batches per step and DP rank =
        global_batch_size / (micro_batch_size · dp).
    seq_len: tokens per sequence (prompt + response; also the engines' max_model_len).
    dtype: "bf16" (bf16 params and activations, fp32 main params in the optimizer) or "fp32".
    grad_dtype: dtype of the DDP gradient buffer: "fp32" (megatron's grad_reduce_in_fp32, what
        `trainer.megatron_train` uses) or "bf16" (bf16 grads; needs dtype "bf16").
    recompute: activation recomputation — "none", "selective" (megatron's core-attention
        recompute) or "full" (every layer, uniform, 1 layer per unit).
    kernels: the layer implementation the activation estimate assumes — "te"
        (TransformerEngine, what `models.gpt.layer_spec` picks on GPU: fused norm + linear,
        flash attention), "local" (megatron's local spec, CPU: torch RMSNorm, unfused
        attention keeping the s² softmax), or "auto" (te on GPU, local on CPU).
    critic: train a critic (same model, scalar value head). reference: keep a reference
        model (same model, forward only, for the KL term).
    """

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_len: int = 4096
    dtype: Literal["fp32", "bf16"] = "bf16"
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    recompute: Literal["none", "selective", "full"] = "none"
    kernels: Literal["auto", "te", "local"] = "auto"
    critic: bool = False
    reference: bool = True

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if self.grad_dtype == "bf16" and self.dtype != "bf16":
            raise ConfigError("grad_dtype", self.grad_dtype, 'bf16 grads need dtype: "bf16"')

    @property
    def num_micro_batches(self) -> float:
        """Micro batches per step and DP rank (not an integer when the batch does not split;
        preflight reports that)."""
        return self.global_batch_size / (self.micro_batch_size * self.parallel.dp)


@dataclass(frozen=True, kw_only=True)
class RolloutShape:
    """The vLLM rollout engines (see `rollout.engine.RolloutConfig` for the running engine).

    tp: tensor-parallel size of each engine; engines: data-parallel engines.
    dtype: weights and KV-cache dtype.
    gpu_memory_utilization: the fraction of each device vLLM takes for weights, activations
        and KV cache (the KV cache gets what is left). null: the KV cache is sized to hold
        max_num_seqs sequences of seq_len tokens instead (CPU engines, `kv_cache_gib`).
    max_num_seqs: sequences batched per engine step. max_num_batched_tokens: tokens per
        engine step (sizes vLLM's activation peak).
    executor: vLLM's distributed_executor_backend — "uni" (in-process, tp 1), "mp" (one
        process per TP rank on one node) or "ray".
    sleep: what a colocated engine frees while the trainer runs — "none" (nothing), "kv"
        (`sleep` of the KV cache only; weights stay), "all" (weights offloaded or discarded
        and KV freed: vLLM sleep level 1 or 2). No effect on CPU, where sleep is a no-op.
    """

    tp: int = 1
    engines: int = 1
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    gpu_memory_utilization: float | None = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    executor: Literal["uni", "mp", "ray"] = "mp"
    sleep: Literal["none", "kv", "all"] = "all"

    def __post_init__(self) -> None:
        for name in ("tp", "engines", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ConfigError("gpu_memory_utilization", util, "must be in (0, 1] (or null)")

    @property
    def world_size(self) -> int:
        return self.tp * self.engines


def resolve_model(model: str | ModelSpec, field_name: str = "model") -> ModelSpec:
    """A preset name, an HF directory (config.json) or a ModelSpec → the ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if model in PRESETS:
        return PRESETS[model]
    if not (Path(model) / "config.json").is_file():
        raise ConfigError(field_name, model, "neither a preset "
                          f"({', '.join(sorted(PRESETS))}) nor a directory with config.json")
    return ModelSpec.from_hf_dir(model)


@dataclass(frozen=True, kw_only=True)
class RewardShape:
    """A reward model (forward only). Its ranks share the training devices: reward rank r
    sits on the device of actor rank r mod the actor's world (see launch/placement.py).

    model: a preset, an HF sequence-classifier directory, or its ModelSpec.
    parallel: its own grid. dtype: its weights and activations. micro_batch_size: sequences
    per forward micro batch (of the run's train.seq_len tokens).
    """

    model: str | ModelSpec
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: Literal["fp32", "bf16"] = "bf16"
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ConfigError("micro_batch_size", self.micro_batch_size, "must be >= 1")
        if not isinstance(self.model, ModelSpec):
            resolve_model(self.model)

    def spec(self) -> ModelSpec:
        return resolve_model(self.model)


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """The hardware a run is sized for.

    device: "gpu" or "cpu" (decides the known-good backends and the attention kernel).
    nodes, gpus_per_node: the allocation (on CPU: processes per node). device_gib: memory of
        one device. reserve_gib: per device, memory the estimate leaves for what it does not
        model (CUDA context, NCCL buffers, allocator fragmentation, transient workspaces).
    placement: "colocated" (every device holds one actor rank and one engine rank; the
        engines sleep during training) or "disaggregated" (engines on their own devices:
        actor world + rollout.tp · rollout.engines devices).
    sync_backend: the weight-sync transport's process-group backend ("nccl" / "gloo").
    """

    device: Literal["gpu", "cpu"] = "gpu"
    nodes: int = 1
    gpus_per_node: int = 8
    device_gib: float = 80.0
    reserve_gib: float = 3.0
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    sync_backend: Literal["nccl", "gloo"] = "nccl"

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")
        if not self.device_gib > 0:
            raise ConfigError("device_gib", self.device_gib, "must be > 0")
        if self.reserve_gib < 0:
            raise ConfigError("reserve_gib", self.reserve_gib, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RunShape(Allocation):
    """One RL run as the planner sees it: an `Allocation` plus

    model: a preset name (`mcore_rl.models.presets`), an HF model directory (config.json), or
        the ModelSpec itself (e.g. the demo model before it is built).
    train / rollout: the training roles' and the engines' shapes.
    reward_model: a reward model on the training devices, or null.
    """

    model: str | ModelSpec
    train: TrainShape = field(default_factory=TrainShape)
    rollout: RolloutShape = field(default_factory=RolloutShape)
    reward_model: RewardShape | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, ModelSpec):
            resolve_model(self.model)

    def spec(self) -> ModelSpec:
        """The model's shapes (preset, or the HF directory's config.json)."""
        return resolve_model(self.model)

    @property
    def model_name(self) -> str:
        if isinstance(self.model, ModelSpec):
            m = self.model
            return f"{m.architecture} (hidden {m.hidden}, {m.layers} layers)"
        return self.model

    @property
    def total_devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def kernels(self) -> str:
        """The layer kernels the activation estimate assumes ("te" or "local")."""
        if self.train.kernels != "auto":
            return self.train.kernels
        return "te" if self.device == "gpu" else "local"


__all__ = ["Allocation", "GiB", "RewardShape", "RolloutShape", "RunShape", "TrainShape",
           "resolve_model"]
