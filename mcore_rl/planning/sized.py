"""`SizedRun`: what the memory planner and preflight size — the run config (`RLConfig`, the
file `mcore-rl train` reads), the device it resolves to, the allocation (`ClusterConfig`, a
"local" cluster resolved to this machine) and the model's shapes.

It adds no fields of its own: every number the planner uses is an RLConfig field or derived
from one here, the way the runtime derives it (the global batch, the trainer's fp32 grads,
vLLM's batch defaults, what a sleeping engine frees). The device facts (layer spec, sync
backend, the allocation) come from `mcore_rl.runconfig.resolve`, the rules the controller uses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mcore_rl.config import ConfigError, from_dict, parse_overrides, to_dict
from mcore_rl.launch.cluster import ClusterConfig
from mcore_rl.megatron.config import TrainConfig
from mcore_rl.models.presets import PRESETS
from mcore_rl.models.spec import ModelSpec
from mcore_rl.rollout.config import vllm_batch_defaults
from mcore_rl.runconfig import RLConfig
from mcore_rl.runconfig.resolve import (
    Device,
    layer_spec_of,
    local_devices,
    resolved_cluster,
    run_device,
    sync_backend_of,
)

GiB = 1 << 30

# `megatron.train` reduces gradients in fp32 (megatron's grad_reduce_in_fp32) whatever
# train.dtype is; the planner sizes the DDP grad buffer the same way.
TRAINER_GRAD_DTYPE = "float32"


def resolve_model(model: str | ModelSpec, field_name: str = "model") -> ModelSpec:
    """A preset name, an HF directory (config.json) or a ModelSpec → the ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if model in PRESETS:
        return PRESETS[model]
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            field_name,
            model,
            f"neither a preset ({', '.join(sorted(PRESETS))}) nor a directory with config.json",
        )
    try:  # an architecture we do not support: one line, as `mcore-rl convert` says it
        return ModelSpec.from_hf_dir(model)
    except KeyError as err:
        raise ConfigError(field_name, model, f"{config_file}: no {err} field") from None
    except ValueError as err:  # UnsupportedModelError, or JSON that does not parse
        raise ConfigError(field_name, model, f"{config_file}: {err}") from None


def model_name(model: str | ModelSpec) -> str:
    if isinstance(model, ModelSpec):
        return f"{model.architecture} (hidden {model.hidden}, {model.layers} layers)"
    return model


@dataclass(frozen=True)
class SizedRun:
    """An RL run as the planner sizes it (see the module docstring).

    cfg: the run config. device: what it resolves to ("cpu"/"cuda"). cluster: the allocation
    (device "gpu"/"cpu"). spec: the policy's shapes; reward_spec: the reward model's (None
    when it is off). model: what the shapes were read from (a preset, a directory, or the
    demo spec). assume_gpu: whether the device was assumed (kept for re-sizing variants).
    layer_spec: the layer spec the trainers build, where it is not the device's (the GPU check
    trains with the local spec on a GPU without TransformerEngine); None: the device's.
    """

    cfg: RLConfig
    device: Device
    cluster: ClusterConfig
    spec: ModelSpec
    reward_spec: ModelSpec | None
    model: str | ModelSpec
    assume_gpu: bool = False
    layer_spec: str | None = None

    @property
    def model_name(self) -> str:
        return model_name(self.model)

    @property
    def kernels(self) -> str:
        """The layer kernels the activation estimate assumes: the resolved layer spec."""
        return self.layer_spec or layer_spec_of(self.device)

    @property
    def sync_backend(self) -> str:
        return sync_backend_of(self.cfg, self.device)

    @property
    def critic(self) -> bool:
        return self.cfg.algorithm.advantage_estimator == "gae"

    @property
    def reference(self) -> bool:
        """A reference model of its own: KL on, and no LoRA (whose reference is the actor's
        base with the adapters off)."""
        return self.cfg.algorithm.kl_coeff > 0 and not self.cfg.actor.lora.enabled

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all DP ranks, as the controller splits a step."""
        c = self.cfg
        return c.prompts_per_step * c.samples_per_prompt // c.updates_per_batch

    def num_micro_batches(self, train: TrainConfig) -> float:
        """Micro batches per optimizer step and DP rank (not whole when the batch does not
        split; preflight reports that)."""
        return self.global_batch / (train.micro_batch_size * self.cfg.actor.dp)

    @property
    def engine_sleeps(self) -> bool:
        """A colocated engine frees its weights and KV cache while the trainer runs (vLLM
        sleep level 1 offloads the weights, 2 discards them) — on GPU; on CPU vLLM's sleep
        is a no-op."""
        return self.cfg.rollout.enable_sleep and self.device == "cuda"

    @property
    def gpu_memory_utilization(self) -> float | None:
        """The fraction of a GPU vLLM takes; None on CPU, where the KV cache is
        rollout.kv_cache_gib."""
        return self.cfg.rollout.gpu_memory_utilization if self.device == "cuda" else None

    @property
    def max_num_batched_tokens(self) -> int:
        r = self.cfg.rollout
        if r.max_num_batched_tokens is not None:
            return r.max_num_batched_tokens
        return vllm_batch_defaults(self.device, self.cluster.device_gib, r.tp)[0]

    @property
    def max_num_seqs(self) -> int:
        r = self.cfg.rollout
        if r.max_num_seqs is not None:
            return r.max_num_seqs
        return vllm_batch_defaults(self.device, self.cluster.device_gib, r.tp)[1]


def sized_run(
    cfg: RLConfig,
    *,
    assume_gpu: bool = False,
    cuda_available: bool | None = None,
    model_dir: str | Path | None = None,
) -> SizedRun:
    """Size `cfg` on this machine (or an assumed GPU machine). `model_dir`: the directory the
    run will load (the built demo model); None sizes from `cfg.model.planning_model()`.
    Raises ConfigError naming the field when there is nothing to size a model from."""
    device = run_device(cfg, assume_gpu=assume_gpu, cuda_available=cuda_available)
    model = str(model_dir) if model_dir is not None else cfg.model.planning_model()
    spec = resolve_model(model, "model.hf_dir")
    reward_spec = None
    if cfg.reward_model.enabled:
        reward_spec = resolve_model(cfg.reward_model.planning_model(), "reward_model.hf_dir")
    cluster = resolved_cluster(cfg, device, cuda_available=cuda_available)
    return SizedRun(
        cfg=cfg,
        device=device,
        cluster=cluster,
        spec=spec,
        reward_spec=reward_spec,
        model=model,
        assume_gpu=assume_gpu,
    )


def with_overrides(run: SizedRun, overrides: list[str] | tuple[str, ...]) -> SizedRun:
    """`run` with RLConfig overrides (`a.b.c=value`) applied, validated like a loaded config
    and re-sized on the same device; the model's shapes are kept."""

    def merge(base: dict, extra: dict) -> dict:
        out = dict(base)
        for k, v in extra.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    cfg = from_dict(type(run.cfg), merge(to_dict(run.cfg), parse_overrides(list(overrides))))
    on_gpu = run.device == "cuda"
    device = run_device(cfg, assume_gpu=on_gpu, cuda_available=on_gpu)
    if cfg.cluster.device == "local" and device == run.device:  # this machine, measured once
        cluster = replace(run.cluster, gpus_per_node=local_devices(cfg))
    else:
        cluster = resolved_cluster(cfg, device, cuda_available=on_gpu)
    return SizedRun(
        cfg=cfg,
        device=device,
        cluster=cluster,
        spec=run.spec,
        reward_spec=run.reward_spec,
        model=run.model,
        assume_gpu=run.assume_gpu,
        layer_spec=run.layer_spec,
    )


__all__ = [
    "GiB",
    "SizedRun",
    "TRAINER_GRAD_DTYPE",
    "model_name",
    "resolve_model",
    "sized_run",
    "with_overrides",
]
