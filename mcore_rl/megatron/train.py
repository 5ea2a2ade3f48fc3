"""A training step through megatron-core: its schedules, DDP, finalize_model_grads, optimizer.

Per step each data-parallel rank gets its own micro batches (tokens, labels, loss_mask): fixed
[micro_batch_size, seq_len] rows, or packed [1, T] rows (`mcore_rl.megatron.packing`; T may vary
between micro batches without pipeline parallelism, and a DP rank may get more or fewer micro
batches than another: the gradient reduce and the token-count all-reduce run once per step, in
`finalize_model_grads`). megatron's schedule (`mcore_rl.megatron.schedule`) runs them through
this rank's model chunks (no pipelining, 1F1B, or interleaved 1F1B with VPP); DDP reduces the
gradients over DP (reduce-scatter with the distributed optimizer), `finalize_model_grads` adds
the TP/PP reductions (SP norms, tied embeddings) and divides by the number of loss tokens of the
global batch; the megatron optimizer clips and steps. The loss is the token mean over the global
batch, the same number a one-process run over all micro batches gives.

Process groups are passed explicitly (`ParallelGroups`); megatron's own layers still read the
parallel_state globals that `init_training_groups` set for the same grid.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from mcore_rl.config.seeds import derive_seed
from mcore_rl.compat import apply_cpu_compat
from mcore_rl.models.gpt import MoEOptions, build_gpt_model, transformer_config_from_spec
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.groups import Axis, ParallelGroups
from mcore_rl.config.dtypes import torch_dtype
from mcore_rl.megatron.config import (LoRAConfig, OptimizerConfig, TrainConfig,
                                      check_model_fits_parallel)
from mcore_rl.megatron.lora import attach_lora
from mcore_rl.megatron.packing import model_inputs
from mcore_rl.megatron.schedule import configure_schedule, run_schedule



@dataclass(frozen=True)
class MicroBatch:
    """One micro batch, [micro_batch_size, seq_len] each: input tokens, the next-token labels,
    and loss_mask (1.0 where the label counts in the loss). Packed: [1, T] each, and
    segment_ids [1, T] (which sequence each token belongs to; see `packing.pack`)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor | None = None
    segment_lengths: tuple[int, ...] | None = None  # packed: the host counts (`packing.pack`)
    routing: torch.Tensor | None = None  # MoE experts to replay per token (routing_replay)
    # the label positions [lo, hi) a log-prob pass computes logits for (its response tokens,
    # `packing.response_window`; `policy.compute_logprobs`); None: all
    logit_window: tuple[int, int] | None = None


@dataclass(frozen=True)
class StepResult:
    """Identical on every rank: global token-mean loss, gradient norm before clipping, number
    of loss tokens in the global batch."""

    loss: float
    grad_norm: float
    num_tokens: int


@dataclass
class MegatronTrainer:
    """What a training step needs: the DDP-wrapped chunks, optimizer, scheduler and groups."""

    spec: ModelSpec
    config: TransformerConfig
    model: list[DistributedDataParallel]
    optimizer: object
    scheduler: OptimizerParamScheduler
    groups: ParallelGroups
    train: TrainConfig
    lora: LoRAConfig | None = None  # adapters on a frozen base (`megatron.lora`)

    def unwrapped(self) -> list[torch.nn.Module]:
        """The GPTModel chunks (state-dict keys as `mcore_rl.layouts.megatron_shards`)."""
        chunks = [ddp.module for ddp in self.model]
        return [c.module if isinstance(c, Float16Module) else c for c in chunks]


# --- set-up -----------------------------------------------------------------------------------


def setup_trainer(spec: ModelSpec, groups: ParallelGroups, train: TrainConfig,
                  load_weights: Callable[[list[torch.nn.Module]], None] | None = None, *,
                  layer_spec: str = "local", fused_kernels: bool | None = None,
                  overlap_grad_reduce: bool | None = None,
                  compiled_fusions: bool | None = None,
                  lora: LoRAConfig | None = None,
                  seed: int = derive_seed(0, "train")) -> MegatronTrainer:
    """Build model chunks with megatron's `layer_spec` (the run's `ResolvedRun.layer_spec`),
    load weights (`load_weights(chunks)`, before the optimizer copies them into its fp32 main
    params), wrap them in DDP and build the optimizer. fused_kernels / overlap_grad_reduce /
    compiled_fusions: the run plan's (`ResolvedRun`); None: `train`'s, where unset off.
    lora: adapters on the loaded weights, which are frozen: the grad buffers and the optimizer
    hold the adapters only (`megatron.lora.attach_lora`)."""
    fused = bool(train.fused_kernels if fused_kernels is None else fused_kernels)
    overlap = bool(train.overlap_grad_reduce if overlap_grad_reduce is None
                   else overlap_grad_reduce)
    compiled = train.compile if compiled_fusions is None else compiled_fusions
    apply_cpu_compat(groups.device)
    parallel = groups.config
    check_model_fits_parallel(spec, parallel, train)
    dtype = torch_dtype(train.dtype)
    config = transformer_config_from_spec(spec, parallel, params_dtype=dtype,
                                          recompute=train.recompute, layer_spec=layer_spec,
                                          moe=MoEOptions(train.moe_dispatcher,
                                                         train.moe_aux_loss_coeff),
                                          fused_kernels=fused, compiled_fusions=compiled,
                                          device=groups.device)
    chunks = build_gpt_model(spec, parallel, groups, params_dtype=dtype, seed=seed,
                             config=config, layer_spec=layer_spec)
    if load_weights is not None:
        load_weights(chunks)
    if lora is not None and lora.enabled:
        attach_lora(chunks, lora)
    model = wrap_ddp(chunks, config, groups, overlap_grad_reduce=overlap)
    optimizer = build_optimizer(model, train.optimizer, dtype, groups)
    scheduler = build_scheduler(optimizer, train.optimizer)
    configure_schedule(config, model, optimizer)
    return MegatronTrainer(spec=spec, config=config, model=model, optimizer=optimizer,
                           scheduler=scheduler, groups=groups, train=train,
                           lora=lora if lora is not None and lora.enabled else None)


def add_lora(trainer: MegatronTrainer, lora: LoRAConfig) -> None:
    """Adapters on a trainer built without them (after a full-model warm-up): the chunks are
    frozen and re-wrapped, so the new grad buffers hold the adapters only and the old ones are
    dropped. The caller builds the optimizer afterwards (`build_optimizer`)."""
    chunks = trainer.unwrapped()
    overlap = trainer.model[0].ddp_config.overlap_grad_reduce
    attach_lora(chunks, lora)
    for chunk in chunks:
        for param in chunk.parameters():
            if not param.requires_grad and hasattr(param, "main_grad"):
                del param.main_grad  # a view of the old grad buffer
    trainer.model = wrap_ddp(chunks, trainer.config, trainer.groups,
                             overlap_grad_reduce=overlap)
    trainer.lora = lora


def wrap_ddp(chunks: list[torch.nn.Module], config: TransformerConfig,
             groups: ParallelGroups, *,
             overlap_grad_reduce: bool = False) -> list[DistributedDataParallel]:
    """megatron's DDP around each chunk: grads accumulate into fp32 contiguous buffers and are
    reduced over DP after the last micro batch — bucket by bucket as the backward produces
    them with `overlap_grad_reduce`, else all at its end. Only chunk 0 gets buckets, as in
    Megatron-LM (later chunks reduce as one)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=False,
        use_distributed_optimizer=groups.config.use_distributed_optimizer,
        # megatron checks each bucket as it is reduced, a host sync per bucket: inside an
        # overlapped backward that stalls the overlap. `checked_step` checks the whole
        # gradient once per step instead, before any weight moves.
        check_for_nan_in_grad=False)
    if config.bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0, pg_collection=groups.megatron)
            for i, chunk in enumerate(chunks)]


def build_optimizer(model: list[DistributedDataParallel], cfg: OptimizerConfig,
                    dtype: torch.dtype, groups: ParallelGroups):
    """megatron's Adam; with bf16 it keeps fp32 main params. With the distributed optimizer
    each DP rank owns 1/dp of the main params and optimizer state (ZeRO-1)."""
    opt_config = MegatronOptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=groups.config.use_distributed_optimizer)
    # use_gloo_process_groups: megatron's extra gloo groups for host-side optimizer-state
    # gathers; it refuses them with explicit groups (and on CPU the groups are gloo already).
    return get_megatron_optimizer(opt_config, model, use_gloo_process_groups=False,
                                  pg_collection=groups.megatron)


def build_scheduler(optimizer, cfg: OptimizerConfig) -> OptimizerParamScheduler:
    """Linear warm-up to lr, then constant or cosine to min_lr (sets each group's lr).
    Step k (from 0) trains at lr·(k+1)/lr_warmup_steps during warm-up: megatron's scheduler
    would give the very first step lr 0, so it starts one step in."""
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=cfg.lr_warmup_steps + cfg.decay_steps,
        lr_decay_style=cfg.decay, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant")
    if cfg.lr_warmup_steps:
        scheduler.step(increment=1)
    return scheduler


# --- loss -------------------------------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab: int,
                   tp_rank: int) -> torch.Tensor:
    """log p(label) per token, from this TP rank's vocab slice of the logits.

    logits: [b, s, V_pad / tp] (rank t holds vocab ids [t·V_pad/tp, (t+1)·V_pad/tp)).
    Megatron's padded vocab rows are not part of the model: their logits are set to -inf so
    the softmax runs over the true vocabulary only (as in HF and vLLM). The cross entropy
    itself is megatron's vocab-parallel one (all-reduces over the TP group).
    """
    per_rank = logits.shape[-1]
    first_pad = vocab - tp_rank * per_rank
    # A copy: megatron's cross entropy subtracts the max in place.
    logits = logits.to(torch.float32, copy=True)
    if first_pad < per_rank:
        logits[..., max(first_pad, 0):] = float("-inf")
    return -tensor_parallel.vocab_parallel_cross_entropy(logits, labels)


def _lm_loss(batch: MicroBatch, vocab: int, tp_rank: int, logits: torch.Tensor):
    """Loss function handed to the schedule: (sum of token losses, token count, report)."""
    mask = batch.loss_mask.float()
    loss_sum = -(token_logprobs(logits, batch.labels, vocab, tp_rank) * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm": torch.stack([loss_sum.detach(), mask.sum()])}


def _forward_step(data_iterator: Iterator[MicroBatch], model, *, vocab: int, tp_rank: int):
    batch = next(data_iterator)
    logits = model(**model_inputs(batch, model.config))
    return logits, functools.partial(_lm_loss, batch, vocab, tp_rank)


# --- the step ---------------------------------------------------------------------------------


def optimizer_step(trainer: MegatronTrainer, micro_batches: list, forward_step,
                   what: str = "optimizer step") -> tuple[list[dict], float]:
    """Zero the grads, run the forward-backward schedule over `micro_batches`, step the
    optimizer and the LR schedule. Returns the loss functions' reports (last stage only) and
    the global grad norm before clipping."""
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    reports = run_schedule(trainer.model, trainer.groups, micro_batches, forward_only=False,
                           forward_step=forward_step)
    grad_norm = checked_step(trainer.optimizer, what)
    trainer.scheduler.step(increment=1)
    return reports, grad_norm


def checked_step(optimizer, what: str = "optimizer step") -> float:
    """megatron's `optimizer.step()` with the global gradient norm checked before the update
    (megatron's own step clips by a NaN norm as by any other and applies it): its pieces —
    prepare the grads, the norm over every parallel group (one host sync), clip by it, step
    — with FloatingPointError, no weight moved, where the norm is not finite. Returns it."""
    if optimizer.prepare_grads():
        raise FloatingPointError(f"{what} skipped: gradients overflowed")
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"{what} skipped: the gradient norm is {grad_norm} (a NaN or "
                                 f"inf gradient on some rank); no weight was updated")
    for each in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = each.get_parameters()
        if each.config.clip_grad > 0.0 and params:
            # the function megatron's own step calls (compat wraps it on the CPU)
            megatron_optimizer.clip_grad_by_total_norm_fp32(
                params, max_norm=each.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=each.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    if not optimizer.step_with_ready_grads():
        raise FloatingPointError(f"{what} skipped: the optimizer refused its update")
    return grad_norm


def train_step(trainer: MegatronTrainer, micro_batches: list[MicroBatch]) -> StepResult:
    """One optimizer step on this DP rank's `micro_batches`; every rank returns the same
    global loss and grad norm."""
    vocab, tp_rank = trainer.spec.vocab, trainer.groups.rank_in(Axis.TP)
    reports, grad_norm = optimizer_step(
        trainer, micro_batches,
        functools.partial(_forward_step, vocab=vocab, tp_rank=tp_rank))
    loss_sum, num_tokens = global_report_sum([r["lm"] for r in reports], trainer.groups, 2)
    return StepResult(loss=float(loss_sum) / max(float(num_tokens), 1), grad_norm=grad_norm,
                      num_tokens=int(num_tokens))


def global_report_sum(reports: list[torch.Tensor], groups: ParallelGroups,
                      size: int) -> torch.Tensor:
    """Sum per-micro-batch report vectors (length `size`) over micro batches and DP ranks,
    then share the total over PP (only the last stage has reports). Float64, on the device
    the DP group's backend reduces on (NCCL: the current CUDA device; gloo: the host)."""
    on_gpu = dist.get_backend(groups.group(Axis.DP)) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    total = torch.zeros(size, dtype=torch.float64, device=device)
    for report in reports:  # empty except on the last stage
        total += report.double().to(device)
    dist.all_reduce(total, group=groups.group(Axis.DP))
    pp_group = groups.group(Axis.PP)
    dist.broadcast(total, src=dist.get_global_rank(pp_group, groups.config.pp - 1),
                   group=pp_group)
    return total


def forward_logits(model: list[torch.nn.Module], micro_batches: list[MicroBatch], *,
                   vocab: int, groups: ParallelGroups) -> list[torch.Tensor] | None:
    """Full-vocab logits [b, s, vocab] (fp32, padding cut) per micro batch on the last pipeline
    stage (gathered over TP); None on other stages. Runs the forward-only schedule over this
    rank's chunks (`trainer.model`, or bare `build_gpt_model` chunks)."""

    def collect(logits, non_loss_data=False):
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return full[..., :vocab].float()

    def step(data_iterator, chunk):
        return chunk(**model_inputs(next(data_iterator), chunk.config)), collect

    with torch.no_grad():
        out = run_schedule(model, groups, micro_batches, forward_step=step, forward_only=True,
                           collect_non_loss_data=True)
    return out if groups.is_last_stage else None
