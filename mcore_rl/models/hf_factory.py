"""Random-weight HF model folders built locally from a `ModelSpec` (no hub access).

`hf_config_from_spec` is the one writer of HF config fields; `ModelSpec.from_hf_config` is
the one reader, and `from_hf_config(hf_config_from_spec(s)) == s` for every spec the writer
accepts. `make_hf_model_dir` builds the model with `transformers` from that config and saves
`config.json`, `generation_config.json`, safetensors (sharded with
`model.safetensors.index.json` when `max_shard_bytes` is small) and the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mcore_rl.models.spec import ARCHITECTURES, ModelSpec, UnsupportedModelError
from mcore_rl.tasks.tokenizer import save_tokenizer

# architecture → (config class, model class) in `transformers`.
_CLASSES = {
    "LlamaForCausalLM": ("LlamaConfig", "LlamaForCausalLM"),
    "MistralForCausalLM": ("MistralConfig", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM"),
    "LlamaForSequenceClassification": ("LlamaConfig", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("MistralConfig", "MistralForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("Qwen2Config", "Qwen2ForSequenceClassification"),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("MixtralConfig", "MixtralForCausalLM"),
}


def hf_config_from_spec(spec: ModelSpec, *, bos_token_id: int | None = None,
                        eos_token_id: int | None = None, pad_token_id: int | None = None,
                        dtype: torch.dtype = torch.float32):
    """The `transformers` config for `spec` (Llama, Mistral or Qwen2 class by
    `spec.architecture`). Raises `UnsupportedModelError` for specs HF cannot express
    exactly:

    - llama family with `qkv_bias`: HF's `attention_bias` also biases `o_proj`, which the
      spec (and Megatron's `add_qkv_bias`) does not have.
    - qwen2 without `qkv_bias` (Qwen2 always has it), or with `head_dim != hidden // heads`
      (Qwen2Config has no `head_dim`; vLLM's Qwen2 derives it from hidden / heads).
    - qwen3 / qwen3_moe without `qk_norm`, or any other family with it (only Qwen3 has q/k
      norms); mixtral with `ffn != moe_ffn` (its one `intermediate_size` is the experts').
    """
    import transformers  # lazy: transformers

    _check_hf_expressible(spec)
    fields: dict[str, Any] = dict(
        architectures=[spec.architecture],
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, hidden_act="silu",
        max_position_embeddings=spec.max_positions, rms_norm_eps=spec.norm_eps,
        tie_word_embeddings=spec.tied_embeddings, rope_parameters=_rope_parameters(spec),
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        dtype=dtype,
    )
    if spec.num_labels is not None:
        fields.update(num_labels=spec.num_labels)
    config_name = _CLASSES[spec.architecture][0]
    fields.update(_class_fields(config_name, spec))
    return getattr(transformers, config_name)(**fields)


def _check_hf_expressible(spec: ModelSpec) -> None:
    """UnsupportedModelError for the specs `hf_config_from_spec` refuses (see its doc)."""
    if spec.architecture not in _CLASSES:
        raise UnsupportedModelError(f"architecture={spec.architecture!r}: no HF writer; "
                                    f"supported: {', '.join(_CLASSES)}")
    family = ARCHITECTURES[spec.architecture]
    if spec.family != family:
        raise UnsupportedModelError(f"family={spec.family!r} does not match "
                                    f"architecture={spec.architecture!r} ({family!r})")
    if family == "llama" and spec.qkv_bias:
        raise UnsupportedModelError("qkv_bias=True on a llama-family model: HF's "
                                    "attention_bias would also add an o_proj bias")
    if family == "qwen2":
        if not spec.qkv_bias:
            raise UnsupportedModelError("qkv_bias=False: Qwen2 always has q/k/v biases")
        if spec.head_dim * spec.heads != spec.hidden:
            raise UnsupportedModelError(f"head_dim={spec.head_dim}: Qwen2 needs head_dim == "
                                        f"hidden // heads = {spec.hidden // spec.heads}")
    if spec.qk_norm != (family in ("qwen3", "qwen3_moe")):
        raise UnsupportedModelError(f"qk_norm={spec.qk_norm}: q/k norms are exactly Qwen3's")
    if family == "mixtral" and spec.ffn != spec.moe_ffn:
        raise UnsupportedModelError(f"ffn={spec.ffn} != moe_ffn={spec.moe_ffn}: Mixtral has one "
                                    "intermediate_size, the experts'")


def _rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    """HF's `rope_parameters`: the spec's rope scaling (its `type` as `rope_type`) + theta."""
    rope: dict[str, Any] = {"rope_type": "default"}
    if spec.rope_scaling:
        rope = {k: v for k, v in spec.rope_scaling.items() if k != "rope_theta"}
        rope.setdefault("rope_type", rope.pop("type", "llama3"))
    rope["rope_theta"] = spec.rope_theta
    return rope


def _class_fields(config_name: str, spec: ModelSpec) -> dict[str, Any]:
    """The fields only `config_name` (an HF config class) has, or whose default it must not
    keep (biases, sliding windows, the MoE router)."""
    if config_name == "LlamaConfig":
        return dict(head_dim=spec.head_dim, attention_bias=False, mlp_bias=False)
    if config_name == "MistralConfig":
        return dict(head_dim=spec.head_dim, sliding_window=None)
    if config_name == "Qwen3Config":
        return dict(head_dim=spec.head_dim, attention_bias=False, use_sliding_window=False,
                    sliding_window=None)
    if config_name == "Qwen3MoeConfig":
        return dict(head_dim=spec.head_dim, attention_bias=False, use_sliding_window=False,
                    sliding_window=None, num_experts=spec.num_experts,
                    moe_intermediate_size=spec.moe_ffn,
                    num_experts_per_tok=spec.experts_per_token,
                    norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=1,
                    mlp_only_layers=[], output_router_logits=False)
    if config_name == "MixtralConfig":
        return dict(head_dim=spec.head_dim, sliding_window=None,
                    num_local_experts=spec.num_experts,
                    num_experts_per_tok=spec.experts_per_token, router_jitter_noise=0.0,
                    output_router_logits=False)
    return dict(use_sliding_window=False, sliding_window=None)  # Qwen2Config


def make_hf_model_dir(spec: ModelSpec, out_dir: str | Path, *, seed: int,
                      tokenizer_dir_or_obj: Any = None, dtype: torch.dtype = torch.float32,
                      max_shard_bytes: int | None = None,
                      randomize_norms_and_biases: bool = True,
                      pad_token_id: int | None = None) -> Path:
    """Build a random-weight HF model for `spec` and save it to `out_dir`; returns the path.

    seed: seeds HF's own init (normal(0, 0.02)) in a forked RNG, so the same seed and spec
        give the same weights and the caller's RNG state is untouched.
    tokenizer_dir_or_obj: a tokenizer folder or object, saved into `out_dir`; the model's
        vocab becomes the tokenizer's size (`len(tokenizer)`) and bos/eos/pad ids come from it.
    max_shard_bytes: shard the safetensors at this size (writes the index); None = one file.
    randomize_norms_and_biases: HF initializes RMSNorm weights to 1 and biases to 0, so a
        converter that swaps two norms or drops a bias would still pass an equality test;
        with this on (default) they become 1 + N(0, 0.1^2) and N(0, 0.02^2) (seeded too).
    pad_token_id: written to config.json when no tokenizer is given (a tokenizer brings its
        own); HF sequence classifiers need it to find each row's last token in a batch.
    """
    import transformers  # lazy: transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special: dict[str, int | None] = {"pad_token_id": pad_token_id}
    if tokenizer_dir_or_obj is not None:
        tok = save_tokenizer(tokenizer_dir_or_obj, out)
        spec = spec.with_(vocab=len(tok))
        special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    config = hf_config_from_spec(spec, dtype=dtype, **special)
    model_cls = getattr(transformers, _CLASSES[spec.architecture][1])
    with torch.random.fork_rng(devices=[]):      # leave the caller's RNG state alone
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = model_cls(config).to(dtype)
    model.eval()
    if randomize_norms_and_biases:
        _randomize_constant_params(model, seed)
    kwargs: dict[str, Any] = {}
    if max_shard_bytes is not None:
        kwargs["max_shard_size"] = int(max_shard_bytes)
    model.save_pretrained(out, **kwargs)
    written = ModelSpec.from_hf_dir(out)
    if written != spec:
        raise RuntimeError(f"{out}/config.json reads back as {written}, not {spec}")
    return out


def make_hf_reward_model_dir(spec: ModelSpec, out_dir: str | Path, *, seed: int,
                             num_labels: int = 1, **kwargs: Any) -> Path:
    """A random-weight HF reward model of `spec`'s decoder: `<Family>ForSequenceClassification`
    (the decoder plus `score.weight` [num_labels, hidden], no bias, no LM head), saved by
    `make_hf_model_dir` (same keyword arguments, e.g. `pad_token_id`, `tokenizer_dir_or_obj`)."""
    arch = spec.architecture.replace("ForCausalLM", "ForSequenceClassification")
    return make_hf_model_dir(spec.with_(architecture=arch, num_labels=num_labels,
                                        tied_embeddings=False), out_dir, seed=seed, **kwargs)


@torch.no_grad()
def _randomize_constant_params(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 0x5EED)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.02 * noise)


def read_safetensors_index(model_dir: str | Path) -> dict[str, str] | None:
    """`weight_map` of a sharded folder (tensor name → shard file), or None if unsharded."""
    index = Path(model_dir) / "model.safetensors.index.json"
    if not index.is_file():
        return None
    return json.loads(index.read_text())["weight_map"]
