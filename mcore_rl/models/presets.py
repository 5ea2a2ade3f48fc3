"""Built-in model presets: shapes only (weights, where needed, are made on the fly).

`tiny` is the few-hundred-MB model the sync benchmark moves for real on CPU; `micro` is what
tests use; the large presets carry published shapes so plans and memory estimates for 70B run
with no weights at all.
"""

from __future__ import annotations

from mcore_rl.models.spec import ModelSpec

_LLAMA = dict(family="llama", architecture="LlamaForCausalLM")
_QWEN3_MOE = dict(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                  norm_topk_prob=True, rope_theta=1000000.0, norm_eps=1e-6, max_positions=40960)

PRESETS: dict[str, ModelSpec] = {
    # Tests: GQA, head dim 32 (vLLM CPU attention needs >= 32), vocab not a multiple of 64.
    "micro": ModelSpec(**_LLAMA, hidden=128, ffn=256, heads=4, kv_heads=2, head_dim=32,
                       layers=4, vocab=250, max_positions=256),
    # Tests and CPU sync checks of experts: Qwen3-MoE shapes at micro size (4 experts, top 2).
    "micro-moe": ModelSpec(**{**_QWEN3_MOE, "max_positions": 256}, hidden=128, ffn=256, heads=4,
                           kv_heads=2, head_dim=32, layers=4, vocab=250, num_experts=4,
                           moe_ffn=64, experts_per_token=2),
    # ~450 MB in fp32: big enough that gather-vs-stream differences show on CPU.
    "tiny": ModelSpec(**_LLAMA, hidden=1024, ffn=2816, heads=8, kv_heads=4, head_dim=128,
                      layers=4, vocab=32000, max_positions=2048),
    # Published shapes (HF config.json of the released checkpoints).
    # Llama 3.2 1B: the ~1B shape the GPU check trains on one device (tied embeddings).
    "llama3.2-1b": ModelSpec(**_LLAMA, hidden=2048, ffn=8192, heads=32, kv_heads=8,
                             head_dim=64, layers=16, vocab=128256, tied_embeddings=True,
                             rope_theta=500000.0, max_positions=131072,
                             rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192}),
    "llama3-8b": ModelSpec(**_LLAMA, hidden=4096, ffn=14336, heads=32, kv_heads=8,
                           head_dim=128, layers=32, vocab=128256, rope_theta=500000.0,
                           max_positions=8192),
    "llama3-70b": ModelSpec(**_LLAMA, hidden=8192, ffn=28672, heads=64, kv_heads=8,
                            head_dim=128, layers=80, vocab=128256, rope_theta=500000.0,
                            max_positions=8192),
    "llama2-13b": ModelSpec(**_LLAMA, hidden=5120, ffn=13824, heads=40, kv_heads=40,
                            head_dim=128, layers=40, vocab=32000, max_positions=4096),
    "qwen2-7b": ModelSpec(family="qwen2", architecture="Qwen2ForCausalLM", hidden=3584,
                          ffn=18944, heads=28, kv_heads=4, head_dim=128, layers=28,
                          vocab=152064, qkv_bias=True, rope_theta=1000000.0,
                          norm_eps=1e-6, max_positions=32768),
    # Qwen3-MoE (HF config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B): every layer
    # routes each token to 8 of 128 experts; head_dim 128 != hidden / heads.
    "qwen3-30b-a3b": ModelSpec(**_QWEN3_MOE, hidden=2048, ffn=6144, heads=32, kv_heads=4,
                               head_dim=128, layers=48, vocab=151936, num_experts=128,
                               moe_ffn=768, experts_per_token=8),
    "qwen3-235b-a22b": ModelSpec(**_QWEN3_MOE, hidden=4096, ffn=12288, heads=64, kv_heads=4,
                                 head_dim=128, layers=94, vocab=151936, num_experts=128,
                                 moe_ffn=1536, experts_per_token=8),
}


def get_preset(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
