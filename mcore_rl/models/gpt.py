"""Build the Megatron-Core GPT model of a `ModelSpec` on a training grid.

`transformer_config_from_spec` is the one mapping from an HF-derived `ModelSpec` (Llama 2/3,
Mistral, Qwen2) to megatron-core's `TransformerConfig`; `build_gpt_model` makes this rank's
model chunks. Weights are loaded separately (mcore_rl.layouts) — the builder only shapes them.

Sharding of what it builds, per rank (tp rank t, pp stage p, VPP chunk v):
  embedding.word_embeddings.weight   [V_pad / tp, hidden]   first stage, chunk 0 only
  linear_qkv.weight                  [(q + 2 kv) / tp, hidden], per query group [q_g; k_g; v_g]
  linear_proj.weight                 [hidden, q_dim / tp]
  linear_fc1.weight                  [2 ffn / tp, hidden] = [gate_t; up_t]
  linear_fc2.weight                  [hidden, ffn / tp]
  norms                              [hidden], replicated
  output_layer.weight                [V_pad / tp, hidden]   last stage, last chunk (untied)
  q_layernorm / k_layernorm          [head_dim], replicated (Qwen3)
  mlp.router.weight                  [experts, hidden], replicated (MoE)
  mlp.experts.local_experts.{j}      expert ep_rank · experts/ep + j: linear_fc1 [2 ffn / etp,
                                     hidden] = [gate_t; up_t], linear_fc2 [hidden, ffn / etp]
                                     (TE spec: the same tensors as mlp.experts.linear_fc1.weight{j}
                                     and linear_fc2.weight{j}, TEGroupedMLP)
with V_pad = spec.mcore_padded_vocab(tp); layers split over stages as ParallelConfig.layer_ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.transformer import TransformerConfig

from mcore_rl.compat import apply_cpu_compat
from mcore_rl.models.kernels import kernel_switches, resolve_kernels
from mcore_rl.models.spec import (
    LayerSpec,
    ModelSpec,
    UnsupportedModelError,
    check_layer_spec,
    grouped_expert_gemm,
)
from mcore_rl.parallel.config import ParallelConfig
from mcore_rl.parallel.groups import Axis, ParallelGroups

# megatron-core's RotaryEmbedding._apply_scaling takes only `factor`; the other llama3 rope
# parameters are fixed at these values (Llama 3.1 / 3.2 use exactly these).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}


def transformer_config_from_spec(spec: ModelSpec, parallel: ParallelConfig, *,
                                 params_dtype: torch.dtype = torch.float32,
                                 init_method_std: float = 0.02,
                                 calculate_per_token_loss: bool = True,
                                 recompute: str = "none",
                                 layer_spec: LayerSpec = "local",
                                 moe: "MoEOptions | None" = None,
                                 fused_kernels: bool = False,
                                 compiled_fusions: bool = False,
                                 device: str) -> TransformerConfig:
    """The TransformerConfig that reproduces the HF model of `spec` on the grid `parallel`.

    Llama-family decoder: pre-RMSNorm, SwiGLU MLP, GQA (num_query_groups = kv heads), rotary
    embeddings in HF's non-interleaved (rotate_half) form, no biases except Qwen2's q/k/v bias.
    Dropout is off: RL needs the trainer's log-probabilities to be a deterministic function of
    the weights. `fused_kernels` (the run plan's, GPU with TransformerEngine) asks for TE's
    fused RoPE and the fused weight-gradient accumulation; `compiled_fusions` (`train.compile`)
    for megatron's torch.compile'd SwiGLU and bias-dropout-add; each is turned on only where
    its provider imports in this process, the one building the model (`kernel_fields`,
    `models.kernels`); every other fusion stays off. On CPU weights are initialized on the
    host (`use_cpu_initialization`).
    `params_dtype` is fp32 or bf16 (bf16 turns on megatron's mixed precision: bf16 params, fp32
    main params in the optimizer).
    `recompute` (TrainConfig.recompute): "none"; "selective" recomputes core attention (the
    s² softmax part); "full" recomputes every layer ("uniform", one layer per checkpoint).
    `layer_spec` is recorded as megatron's own `transformer_impl`, so whatever runs a chunk
    (packing.model_inputs) reads the spec from `chunk.config`, not from the hardware.
    Qwen3: per-head q/k RMSNorm (`qk_layernorm`), kv_channels = head_dim. Mixture of experts
    (Qwen3-MoE, Mixtral): see `moe_config_fields`; `moe` picks the dispatcher and aux loss.
    """
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype={params_dtype}: only torch.float32 and torch.bfloat16")
    if recompute not in _RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: one of {', '.join(_RECOMPUTE)}")
    on_cpu = not device.startswith("cuda")  # the rank's device, as the run plan resolved it
    return TransformerConfig(
        transformer_impl=TRANSFORMER_IMPL[layer_spec],
        **_decoder_fields(spec, init_method_std),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # Softmax in fp32 even with bf16 activations (HF does the same in eager attention).
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=calculate_per_token_loss,
        **_grid_fields(parallel, params_dtype),
        use_cpu_initialization=on_cpu,
        **kernel_fields(fused_kernels, compiled_fusions, device=device),
        **_RECOMPUTE[recompute],
        **moe_config_fields(spec, parallel, moe or MoEOptions(),
                            grouped_gemm=grouped_expert_gemm(layer_spec)),
    )


def _decoder_fields(spec: ModelSpec, init_method_std: float) -> dict:
    """The decoder's shape and maths, as HF's Llama-family model has them (dropout off)."""
    return dict(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        ffn_hidden_size=spec.ffn,
        num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_method_std,
        qk_layernorm=spec.qk_norm,
    )


def _grid_fields(parallel: ParallelConfig, params_dtype: torch.dtype) -> dict:
    """The TP/PP/VPP grid and how pipeline stages exchange activations."""
    return dict(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        sequence_parallel=parallel.sequence_parallel,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        # p2p buffers between stages are allocated in this dtype.
        pipeline_dtype=params_dtype if parallel.pp > 1 else None,
        # Interleaved 1F1B with batch_p2p_comm=True (megatron's default: one batch_isend_irecv
        # per exchange) mixes up peers' activations and gradients over gloo — silently wrong
        # loss and gradients at PP2·VPP2 (checked in
        # tests/megatron/test_parallel_layouts.py). Separate isend/irecv are exact.
        batch_p2p_comm=parallel.vpp is None,
        # batch_p2p_sync calls torch.cuda.synchronize() after each batched exchange: a guard
        # for old PyTorch/NCCL builds that costs a host sync per pipeline exchange on current
        # ones (and raises without CUDA).
        batch_p2p_sync=False,
    )


def kernel_fields(fused: bool, compiled: bool = False, *, device: str) -> dict:
    """megatron's fusion switches, as this process resolves the plan's intent
    (`models.kernels.resolve_kernels`): `fused` asks for TransformerEngine's RoPE kernel and the
    weight-grad accumulation into the fp32 main grads (apex's fused_weight_gradient_mlp_cuda),
    `compiled` (`train.compile`) for the SwiGLU and bias-dropout-add fusions megatron wraps in
    torch.compile; each is on only where its provider imports here, so a process without
    one builds its model without that kernel instead of failing. The rest stay off
    (`models.kernels.KERNELS` says why)."""
    return kernel_switches(resolve_kernels(fused, compiled, device=device))


@dataclass(frozen=True)
class MoEOptions:
    """Training choices for mixture-of-experts layers (the architecture itself is the spec's).

    dispatcher: megatron's token dispatcher, "allgather" or "alltoall" (both run on CPU with
        mcore_rl.compat's shims).
    aux_loss_coeff: load-balancing aux loss weight; 0 (default) turns it off, so the loss is
        exactly the LM loss (RL log-probs and HF comparisons need nothing extra).
    """

    dispatcher: str = "allgather"
    aux_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        if self.dispatcher not in ("allgather", "alltoall"):
            raise ValueError(f"moe dispatcher={self.dispatcher!r}: allgather or alltoall")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"moe aux_loss_coeff={self.aux_loss_coeff}: must be >= 0")


def moe_config_fields(spec: ModelSpec, parallel: ParallelConfig, moe: MoEOptions, *,
                      grouped_gemm: bool = False) -> dict:
    """TransformerConfig fields of a MoE spec ({} for a dense one).

    Routing as HF computes it: logits = router(x); with `norm_topk_prob` (Mixtral, Qwen3-MoE
    when set) the weights are the softmax over the top-k logits — megatron's default order
    (top-k, then softmax) gives exactly that; without it (Qwen3-MoE norm_topk_prob=false) the
    softmax over all experts taken at the top k — `moe_router_pre_softmax`. Experts run as
    SequentialMLP (one local MLP per expert) or, with `grouped_gemm` (the TE layer spec:
    `models.spec.grouped_expert_gemm`), as TEGroupedMLP (one grouped GEMM per linear over the
    rank's experts); no capacity limit, no shared experts.
    """
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.experts_per_token,
        moe_ffn_hidden_size=spec.moe_ffn,
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=grouped_gemm,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )


# Our layer spec name → TransformerConfig.transformer_impl (megatron-core 0.16.1's names).
TRANSFORMER_IMPL = {"local": "local", "te": "transformer_engine"}

# TrainConfig.recompute → megatron's recompute settings.
_RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},  # recompute_modules: core_attn
    "full": {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1},
}


def rope_kwargs(spec: ModelSpec) -> dict:
    """GPTModel's rotary arguments for the spec's rope (default or llama3 scaling)."""
    kwargs = {"position_embedding_type": "rope", "rotary_base": spec.rope_theta,
              "rotary_percent": 1.0}
    if spec.rope_scaling is None:
        return kwargs
    scaling = spec.rope_scaling
    for key, fixed in _MEGATRON_LLAMA3_ROPE.items():
        if float(scaling.get(key, fixed)) != fixed:
            raise UnsupportedModelError(
                f"rope_scaling.{key}={scaling[key]}: megatron-core 0.16.1 fixes it at {fixed}")
    return {**kwargs, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


class LayerSpecError(ValueError):
    """A layer spec that cannot be built here (names the `layer_spec` and what is missing)."""


def layer_spec(name: LayerSpec, spec: ModelSpec | None = None):
    """megatron-core's layer spec called `name`, as the resolved run chose it (`run.layer_spec`):
    "local" (pure PyTorch; runs anywhere) or "te" (TransformerEngine; needs TE, so CUDA).
    `spec` adds Qwen3's q/k norms and MoE layers (experts as `grouped_expert_gemm(name)` says:
    SequentialMLP under "local", TEGroupedMLP under "te").

    The two build the same tensors under partly different names (`layouts.Side.megatron_name`);
    every load and the weight sync name tensors by the same `name`.
    """
    check_layer_spec(name)
    arch = {} if spec is None else dict(num_experts=spec.num_experts,
                                        moe_grouped_gemm=grouped_expert_gemm(name),
                                        qk_layernorm=spec.qk_norm)
    if name == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **arch)
    if not te_importable():
        raise LayerSpecError(
            "layer_spec='te' needs TransformerEngine (`import transformer_engine.pytorch`), "
            "which is not importable here; the resolved run picks 'te' on CUDA "
            "(planning.resolve) — install it (`pip install .[gpu]`) or run on CPU, where "
            "layer_spec='local'")
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**arch)


_layer_spec = layer_spec  # build_gpt_model's `layer_spec` argument shadows the function


def te_importable() -> bool:
    """Whether TransformerEngine's PyTorch modules import (the bare `transformer-engine`
    meta-package imports but has no `pytorch`; megatron-core then stubs TE with mocks)."""
    try:
        # lazy: transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or TE's own errors when its CUDA libraries are missing
        return False
    return True


def seed_rngs(seed: int, groups: ParallelGroups) -> None:
    """Same CPU RNG on every rank; megatron's tracker gives TP ranks distinct streams for the
    model-parallel regions (dropout there; none in our configs)."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=groups.rank_in(Axis.TP),
                                                    ep_rank=groups.expert_coords["ep"],
                                                    etp_rank=groups.expert_coords["etp"])


def build_gpt_model(spec: ModelSpec, parallel: ParallelConfig, groups: ParallelGroups, *,
                    params_dtype: torch.dtype = torch.float32, seed: int = 1234,
                    config: TransformerConfig | None = None,
                    layer_spec: LayerSpec = "local",
                    fused_kernels: bool = False,
                    compiled_fusions: bool = False) -> list[GPTModel]:
    """This rank's model chunks: one GPTModel per VPP chunk (one without VPP), built with
    megatron-core's `layer_spec` ("local" or "te": the run's `ResolvedRun.layer_spec`; its
    parameter names are `layouts.megatron_shards(..., layer_spec=layer_spec)`'s).

    Chunk v of stage p holds the layers `parallel.layer_ranges(spec.layers)[(p, v)]`; the
    embedding lives on stage 0 chunk 0, the final norm and output layer on the last stage's
    last chunk (tied embeddings: the output layer reuses the word embedding, which megatron
    also keeps on the last stage and all-reduces over the embedding group). Logits come out
    split over TP ([b, s, V_pad / tp]).

    `seed` seeds the weight init (same on every rank, so replicas start equal) and megatron's
    RNG tracker (which attention enters on every forward). fused_kernels, compiled_fusions: as
    `transformer_config_from_spec`'s (when no `config` is given).
    """
    # fails clearly (no TE) before anything is built
    transformer_layer_spec = _layer_spec(layer_spec, spec)
    apply_cpu_compat(groups.device)
    seed_rngs(seed, groups)
    config = config or transformer_config_from_spec(spec, parallel, params_dtype=params_dtype,
                                                    layer_spec=layer_spec,
                                                    fused_kernels=fused_kernels,
                                                    compiled_fusions=compiled_fusions,
                                                    device=groups.device)
    if config.transformer_impl != TRANSFORMER_IMPL[layer_spec]:
        raise LayerSpecError(f"layer_spec={layer_spec!r} but the given config was made for "
                             f"transformer_impl={config.transformer_impl!r} "
                             "(transformer_config_from_spec(..., layer_spec=...))")
    pp_rank, last_pp = groups.rank_in(Axis.PP), parallel.pp - 1
    num_chunks = parallel.vpp or 1
    chunks = []
    for v in range(num_chunks):
        model = GPTModel(
            config=config,
            transformer_layer_spec=transformer_layer_spec,
            vocab_size=spec.mcore_padded_vocab(parallel.tp),
            max_sequence_length=spec.max_positions,
            pre_process=pp_rank == 0 and v == 0,
            post_process=pp_rank == last_pp and v == num_chunks - 1,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tied_embeddings,
            pg_collection=groups.megatron,
            vp_stage=v if parallel.vpp else None,
            **rope_kwargs(spec),
        )
        if model.post_process and not config.sequence_parallel:
            batch_major_output(model)
        if params_dtype == torch.bfloat16:
            model.bfloat16()
        if groups.device != "cpu":
            # what megatron's own get_model does: not every module megatron builds allocates on
            # the current device (its torch-norm fallback of the local spec starts on the host)
            model.to(groups.device)
        chunks.append(model)
    return chunks


def batch_major_output(chunk: GPTModel) -> None:
    """Compute the chunk's logits batch-major. megatron's GPTModel returns
    `logits.transpose(0, 1).contiguous()`: a copy of the largest activation, [s, b, V/tp] →
    [b, s, V/tp], and two more of its gradient in the backward. Fed the hidden states as
    [b, s, h] (a copy V/h times smaller), the output layer writes [b, s, V/tp] directly and
    hands megatron the [s, b] view of it, whose `.contiguous()` is then free. By forward
    hooks on the layer: a LoRA adapter's (prepended) sees the [b, s] input and output. Not
    with sequence parallelism, where the layer gathers its input along dim 0."""
    layer = chunk.output_layer

    def batch_major_input(_layer, args, kwargs):
        return (args[0].transpose(0, 1).contiguous(), *args[1:]), kwargs

    def sequence_major_view(_layer, _args, output):
        logits, bias = output
        return logits.transpose(0, 1), bias

    layer.register_forward_pre_hook(batch_major_input, with_kwargs=True)
    layer.register_forward_hook(sequence_major_view)


def load_chunks(chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor],
                vpp: int | None) -> None:
    """Load this rank's megatron tensors (keys as `mcore_rl.layouts.megatron_shards` names them
    for the chunks' layer spec: prefixed `model{v}.` per chunk when `vpp` is set) into its
    chunks, strictly: a missing or unexpected key is an error naming it.

    `_extra_state` entries hold no weights (megatron's local linears: None; TE modules: fp8
    scaling state, which a model loaded from plain weights starts afresh): each chunk keeps its
    own, so strict loading checks exactly the parameters under either spec."""
    per_chunk: list[dict[str, torch.Tensor]] = [{} for _ in chunks]
    for key, tensor in tensors.items():
        v, name = _split_chunk_prefix(key, vpp, len(chunks))
        per_chunk[v][name] = tensor
    for v, (chunk, state) in enumerate(zip(chunks, per_chunk)):
        with torch.no_grad():
            chunk.load_state_dict({**own_extra_state(chunk), **state}, strict=True)


def own_extra_state(module: torch.nn.Module) -> dict[str, object]:
    """The module's `_extra_state` entries of its state dict, as they are now."""
    return {k: v for k, v in module.state_dict().items() if k.endswith("_extra_state")}


def _split_chunk_prefix(key: str, vpp: int | None, num_chunks: int) -> tuple[int, str]:
    if vpp is None:
        return 0, key
    head, _, name = key.partition(".")
    if not head.startswith("model") or not head[5:].isdigit() or int(head[5:]) >= num_chunks:
        raise KeyError(f"{key}: with vpp={vpp} keys must start with model<chunk>. "
                       f"(chunk < {num_chunks})")
    return int(head[5:]), name
