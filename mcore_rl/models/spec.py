"""`ModelSpec`: everything mcore-rl needs to know about a decoder, read from an HF config.

It is the one reader of HF `config.json` files. The layout tables and the resharding planner
need only its shapes (so a 70B model can be planned without weights); the Megatron model
builder maps it to a `TransformerConfig`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

# HF architectures → layout family. Mistral uses Llama's tensor names and layouts.
# *ForSequenceClassification: the same decoder with a `score` head [num_labels, hidden] (no
# bias) in place of the LM head (reward models).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

# Families whose decoder layers hold a routed mixture of experts instead of one MLP.
MOE_FAMILIES = ("qwen3_moe", "mixtral")

# Rope scaling types the Megatron builder reproduces exactly.
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(ValueError):
    """The HF config asks for something mcore-rl cannot reproduce exactly."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) or of its
    mixture-of-experts kin (Qwen3-MoE, Mixtral).

    family: layout family ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"), from the HF
        architecture.
    architecture: the HF architecture name (kept for exporting config.json).
    hidden / ffn: hidden size and MLP intermediate size.
    heads / kv_heads / head_dim: attention heads, key-value heads (GQA), per-head size.
    layers: decoder layers. vocab: true (unpadded) vocabulary size.
    tied_embeddings: output layer shares the input embedding.
    qkv_bias: q/k/v projections have biases (Qwen2).
    rope_theta, rope_scaling: rotary embedding base and optional llama3-style scaling dict.
    norm_eps: RMSNorm epsilon. max_positions: maximum sequence length.
    num_labels: None for a causal LM; for a *ForSequenceClassification model the width of its
        `score` head (which replaces the LM head; `tied_embeddings` is then False).
    qk_norm: per-head RMSNorm of q and k (weights of size head_dim) before rope (Qwen3).
    num_experts: routed experts per layer (every layer is a mixture of experts), or None for a
        dense MLP. moe_ffn: each expert's intermediate size (HF `moe_intermediate_size`;
        Mixtral's `intermediate_size`). experts_per_token: top-k experts per token.
    norm_topk_prob: the top-k routing weights are renormalized to sum to 1 (Mixtral always;
        Qwen3-MoE's `norm_topk_prob`); False = the softmax over all experts, taken at the top k.
    """

    family: str
    architecture: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    max_positions: int = 4096
    num_labels: int | None = None
    qk_norm: bool = False
    num_experts: int | None = None
    moe_ffn: int | None = None
    experts_per_token: int | None = None
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "heads", "kv_heads", "head_dim", "layers", "vocab"):
            if getattr(self, name) < 1:
                raise UnsupportedModelError(f"{name}={getattr(self, name)}: must be >= 1")
        if (self.family in MOE_FAMILIES) != (self.num_experts is not None):
            raise UnsupportedModelError(f"family={self.family!r} with num_experts="
                                        f"{self.num_experts}: experts are for "
                                        f"{', '.join(MOE_FAMILIES)} only, and required there")
        if self.num_experts is not None:
            for name in ("num_experts", "moe_ffn", "experts_per_token"):
                if (getattr(self, name) or 0) < 1:
                    raise UnsupportedModelError(f"{name}={getattr(self, name)}: must be >= 1 "
                                                "for a mixture-of-experts model")
            if self.experts_per_token > self.num_experts:
                raise UnsupportedModelError(f"experts_per_token={self.experts_per_token} > "
                                            f"num_experts={self.num_experts}")
        if self.heads % self.kv_heads:
            raise UnsupportedModelError(f"num_attention_heads={self.heads} is not a multiple "
                                        f"of num_key_value_heads={self.kv_heads}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def routed_experts(self) -> int:
        """Routed experts per layer: `num_experts`, 0 for a dense MLP."""
        return self.num_experts or 0

    @property
    def expert_ffn(self) -> int:
        """Each routed expert's intermediate size: `moe_ffn`, 0 for a dense MLP."""
        return self.moe_ffn or 0

    @property
    def top_k(self) -> int:
        """Routed experts per token: `experts_per_token`, 0 for a dense MLP."""
        return self.experts_per_token or 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def mcore_padded_vocab(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron pads the vocabulary to a multiple of `divisible_by * tp` (Megatron-LM's
        --make-vocab-size-divisible-by), so every TP rank holds an equal slice."""
        step = divisible_by * tp
        return -(-self.vocab // step) * step

    def num_params(self) -> int:
        """Parameter count (unpadded vocab)."""
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        attn += (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        if self.is_moe:  # router + experts
            mlp = self.num_experts * (self.hidden + 3 * self.hidden * self.moe_ffn)
        else:
            mlp = 3 * self.hidden * self.ffn
        per_layer = attn + mlp + 2 * self.hidden
        head = self.num_labels if self.num_labels is not None else (
            0 if self.tied_embeddings else self.vocab)
        embed = (self.vocab + head) * self.hidden
        return self.layers * per_layer + embed + self.hidden

    def with_(self, **changes: Any) -> "ModelSpec":
        return replace(self, **changes)

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
        """From a `transformers.PretrainedConfig` (or its dict). Rejects fields we would
        silently get wrong (sliding windows, MLP biases, unknown rope scaling, ...)."""
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architectures={archs}: unsupported; supported: {', '.join(ARCHITECTURES)}")
        _reject_unsupported(cfg)
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        rope_type = (rope.get("rope_type") or (scaling or {}).get("rope_type")
                     or (scaling or {}).get("type") or "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {rope_type!r}: unsupported; supported: "
                                        f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type == "llama3":
            scaling = {k: v for k, v in {**(scaling or {}), **rope}.items() if k != "rope_theta"}
        else:
            scaling = None
        heads = cfg["num_attention_heads"]
        classifier = arch.endswith("ForSequenceClassification")
        family = ARCHITECTURES[arch]
        return cls(
            family=family,
            architecture=arch,
            hidden=cfg["hidden_size"],
            ffn=cfg["intermediate_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            layers=cfg["num_hidden_layers"],
            vocab=cfg["vocab_size"],
            # a classifier has no LM head to tie
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not classifier,
            qkv_bias=family == "qwen2",
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            # config.json stores the labels as id2label; num_labels is derived from it
            num_labels=(len(cfg["id2label"]) if cfg.get("id2label") else
                        int(cfg.get("num_labels", 2))) if classifier else None,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            **_moe_fields(family, cfg),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelSpec":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file}: no config.json in the model directory")
        return cls.from_hf_config(json.loads(config_file.read_text()))


def _moe_fields(family: str, cfg: dict) -> dict:
    """The expert fields of a MoE config (transformers 5 writes `num_local_experts` for
    Qwen3-MoE; released checkpoints say `num_experts`)."""
    if family not in MOE_FAMILIES:
        return {}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise UnsupportedModelError(f"{family}: config has no num_experts / num_local_experts")
    return dict(num_experts=int(experts), experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_ffn=int(cfg["moe_intermediate_size"] if family == "qwen3_moe"
                            else cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True))
                if family == "qwen3_moe" else True)


def _reject_unsupported(cfg: dict) -> None:
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu' / SwiGLU)")
    if cfg.get("attention_bias") and cfg.get("model_type") != "qwen2":
        problems.append("attention_bias=true (q/k/v/o biases; Qwen2's q/k/v biases are "
                        "supported through its own architecture)")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP biases)")
    if cfg.get("use_sliding_window") or (cfg.get("model_type") in ("mistral", "mixtral")
                                         and cfg.get("sliding_window")):
        problems.append(f"sliding_window={cfg.get('sliding_window')} (sliding-window attention)")
    if (cfg.get("model_type") == "qwen2" and cfg.get("head_dim")
            and cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]):
        # vLLM's Qwen2 always uses hidden_size // num_attention_heads.
        problems.append(f"head_dim={cfg['head_dim']} != hidden_size // num_attention_heads "
                        "for qwen2")
    if cfg.get("model_type") == "qwen3_moe" and (cfg.get("mlp_only_layers")
                                                 or cfg.get("decoder_sparse_step", 1) != 1):
        problems.append(f"mlp_only_layers={cfg.get('mlp_only_layers')}, decoder_sparse_step="
                        f"{cfg.get('decoder_sparse_step')} (dense layers among MoE layers)")
    if cfg.get("model_type") == "qwen3_moe" and cfg.get("shared_expert_intermediate_size"):
        problems.append("shared_expert_intermediate_size (shared experts)")
    if cfg.get("model_type") == "mixtral" and cfg.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={cfg['router_jitter_noise']} (random routing)")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        problems.append(f"pretraining_tp={cfg['pretraining_tp']}")
    if problems:
        raise UnsupportedModelError("unsupported HF config fields: " + "; ".join(problems))


# megatron-core's layer specs: "local" (pure PyTorch modules, what runs on CPU) and "te"
# (TransformerEngine modules, GPU). They hold the same tensors; only some names differ.
LayerSpec = Literal["local", "te"]


LAYER_SPECS: tuple[str, ...] = ("local", "te")


def grouped_expert_gemm(layer_spec: str) -> bool:
    """Whether `layer_spec` runs a MoE layer's local experts as one grouped GEMM per linear
    (TransformerEngine's `TEGroupedMLP`: fc1/fc2 hold expert j as `weight<j>`) rather than one
    MLP module per expert (`SequentialMLP`, `local_experts.<j>.linear_fc1.weight`). The TE spec
    does; its dist-checkpoint keys are SequentialMLP's (TEGroupedMLP.sharded_state_dict)."""
    check_layer_spec(layer_spec)
    return layer_spec == "te"


def check_layer_spec(layer_spec: str) -> None:
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"layer_spec={layer_spec!r}: one of {', '.join(LAYER_SPECS)} "
                         "(megatron-core's local or TransformerEngine layer spec)")
