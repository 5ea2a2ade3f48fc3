"""What a decoder layer saves for backward, and how many layers' worth a pipeline stage holds.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv 2205.05198), Table 2, per layer and micro batch (16-bit
activations, GeLU MLP with ffn = 4h, dropout, a heads):
    no parallelism                   s·b·h·(34 + 5·a·s/h)
    TP t                             s·b·h·(10 + 24/t + 5·a·s/(h·t))
    TP t + sequence parallelism      s·b·h/t·(34 + 5·a·s/h)
    ... + selective recomputation    34·s·b·h/t
    full recomputation               2·s·b·h
The first pipeline stage holds p micro batches in flight (1F1B), i.e. L layers' worth;
interleaving with v chunks multiplies that by 1 + (p - 1)/(p·v). Megatron-LM's
`megatron/training/theoretical_memory_usage.py` uses the same Table 2 formulas.
`layer_activation_terms` counts the same saved tensors term by term for a Llama-family layer
(SwiGLU, GQA, RMSNorm, rotary, no dropout; TE or megatron-local kernels) and reduces exactly
to the rows above for the paper's GPT layer (`ActivationModel.paper`, tested). In-flight micro
batches per stage follow megatron's own warm-up rule (`in_flight_layers`), which gives the
paper's figures when a step has at least p micro batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class ActivationModel:
    """What a decoder layer saves for backward: the kernels and the layer's make-up.

    norm: "fused" (TransformerEngine: keeps the norm input, in act dtype) or "composite"
        (torch's CPU RMSNorm: keeps the input upcast to fp32 and the fp32 normalized tensor).
    attention: "flash" (keeps q, k, v and fp32 softmax statistics) or "unfused" (megatron's
        local DotProductAttention: GQA keys/values expanded to all heads, the softmax output,
        a bool causal mask per layer).
    mlp: "swiglu" (megatron's unfused glu: [gate; up], silu(gate), up + offset, product) or
        "gelu" (GeLU input, fc2 input). dropout: dropout masks (1 byte per element) are kept.
    softmax_fp32: the softmax runs (and is kept) in fp32, plus an act-dtype copy for the bmm.
    rope: unfused rotary embedding keeps cos and sin for q and k.
    causal_mask: unfused attention keeps a bool [s, s] causal mask per layer (megatron builds
        its default mask per call when none is passed).
    The paper's GPT layer is `ActivationModel.paper(...)`; ours come from `for_kernels`.
    """

    act_bytes: int
    tp: int = 1
    sequence_parallel: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    norm: Literal["fused", "composite"] = "fused"
    attention: Literal["flash", "unfused"] = "flash"
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    dropout: bool = False
    softmax_fp32: bool = True
    rope: bool = True
    causal_mask: bool = True

    @classmethod
    def for_kernels(cls, kernels: str, **kw) -> ActivationModel:
        """ "te": TransformerEngine layers (GPU); "local": megatron's local spec (CPU)."""
        if kernels == "te":
            return cls(norm="fused", attention="flash", **kw)
        if kernels == "local":
            return cls(norm="composite", attention="unfused", **kw)
        raise ValueError(f"kernels={kernels!r}: te or local")

    @classmethod
    def paper(cls, **kw) -> ActivationModel:
        """Korthikanti et al.'s GPT layer: LayerNorm, unfused MHA with dropout, GeLU MLP,
        16-bit softmax, no rotary embedding."""
        return cls(
            norm="fused",
            attention="unfused",
            mlp="gelu",
            dropout=True,
            softmax_fp32=False,
            rope=False,
            causal_mask=False,
            **kw,
        )


def layer_activation_terms(
    spec: ModelSpec, seq: int, micro_batch: int, model: ActivationModel
) -> dict[str, float]:
    """Bytes one decoder layer saves for backward, per micro batch, on one TP rank, by group.

    Sequence-parallel regions (divided by tp only with SP): the two norms, the inputs of the
    qkv and fc1 linears, the dropout masks. Tensor-parallel regions (divided by tp): q, k, v,
    attention scores and output (proj input), MLP intermediates. Replicated: rotary cos/sin,
    the causal mask. With "selective" recompute core attention keeps only its inputs
    (unexpanded q, k, v); with "full" recompute the layer keeps only its input.
    """
    s, b, B, t = seq, micro_batch, model.act_bytes, model.tp
    h, q, kv, f, a = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn, spec.heads
    sp = t if model.sequence_parallel else 1
    if model.recompute == "full":
        return {"layer input": B * s * b * h / sp}
    norm = (8 * s * b * h + 4 * s * b) if model.norm == "composite" else B * s * b * h
    terms = {"norms": 2 * norm / sp, "qkv, fc1 inputs": 2 * B * s * b * h / sp}
    if model.dropout:
        terms["dropout masks"] = 2 * s * b * h / sp
    if model.rope:
        terms["rotary cos, sin"] = 4 * B * s * spec.head_dim
    core = model.recompute != "selective"
    unfused = model.attention == "unfused"
    if unfused and core and spec.kv_heads < spec.heads:
        qkv = 3 * q  # q and the GQA-expanded k, v that the bmm's keep
    elif model.dropout:  # the paper's count: q, k, v
        qkv = q + 2 * kv
    else:
        # q and k are new tensors (rotary), v is a view of the fused qkv output, which it
        # keeps alive whole (measured for megatron's local attention; assumed for TE)
        qkv = q + kv + (q + 2 * kv)
    terms["q, k, v"] = B * s * b * qkv / t
    terms["attention output"] = B * s * b * q / t
    if core and unfused:
        scores = a * s * s * b / t
        if model.softmax_fp32:
            per = 4 + (B if B != 4 else 0)
        else:
            per = B
        if model.dropout:
            per += 1 + B  # mask, dropped-out probabilities
        terms["attention scores"] = scores * per
        if model.causal_mask:
            terms["causal mask"] = s * s
    elif core:
        terms["attention lse"] = 4 * a * s * b / t
    if model.mlp == "gelu":
        terms["mlp"] = 2 * B * s * b * f / t
    else:
        terms["mlp"] = 5 * B * s * b * f / t
    return terms


def recompute_workspace(
    spec: ModelSpec, seq: int, micro_batch: int, model: ActivationModel
) -> float:
    """Bytes rematerialized at once during backward: one whole layer ("full"), one layer's
    core attention ("selective": scores, expanded k and v), nothing ("none")."""
    if model.recompute == "full":
        return layer_activation_bytes(
            spec, seq, micro_batch, dataclasses.replace(model, recompute="none")
        )
    if model.recompute == "selective":
        full = layer_activation_terms(
            spec, seq, micro_batch, dataclasses.replace(model, recompute="none")
        )
        kept = layer_activation_terms(spec, seq, micro_batch, model)
        return sum(full.values()) - sum(kept.values())
    return 0.0


def layer_activation_bytes(
    spec: ModelSpec, seq: int, micro_batch: int, model: ActivationModel
) -> float:
    return sum(layer_activation_terms(spec, seq, micro_batch, model).values())


def in_flight_layers(
    parallel: ParallelConfig, num_layers: int, stage: int, num_micro_batches: int
) -> int:
    """Layers' worth of one micro batch's activations that stage `stage` holds at its peak,
    from megatron's schedules: no PP — 1 micro batch; 1F1B — min(pp - stage, m) micro batches
    of the stage's layers; interleaved — min(warm-up + 1, m·v) chunk micro batches, warm-up
    = 2·(pp - stage - 1) + (v - 1)·pp, of L/(pp·v) layers each."""
    counts = parallel.stage_layer_counts(num_layers)
    m = max(num_micro_batches, 1)
    if parallel.pp == 1:
        return counts[0]
    if parallel.vpp is None:
        return counts[stage] * min(parallel.pp - stage, m)
    v, pp = parallel.vpp, parallel.pp
    total = m * v
    warmup = 2 * (pp - stage - 1) + (v - 1) * pp
    chunks = total if warmup >= total else warmup + 1
    return chunks * num_layers // (pp * v)
