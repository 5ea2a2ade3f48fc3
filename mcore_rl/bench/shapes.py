"""Realistic shapes for `mcore-rl bench step shape=NAME`: a model of a small real checkpoint's
shape with a real-sized vocabulary, long prompts and long responses, built locally (no
download) so ours and TRL start from the same HF directory.

A shape is one row of `SHAPES`: the model (a `ModelSpec` without its vocabulary), the
tokenizer's vocabulary size, the prompt length in tokens, and the RL config (a YAML under
configs/bench/) holding the step's settings — batch, group, response lengths
(min_new_tokens = max_new_tokens: every response has the same length on both sides), micro
batching, engines. `build_shape` writes into a directory:

    tokenizer + model/   byte-level BPE trained on this package's own source text with
                         `tokenizers` (`vocab` pieces incl. `<|endoftext|>`, the EOS and pad),
                         and a random-weight HF checkpoint (`make_hf_model_dir`)
    prompts.jsonl        `PROMPTS` prompts of exactly `prompt_tokens` tokens each (windows of
                         the same text, kept only when they re-encode to that length), each
                         with an empty answer; the reward is `letter_share_reward`, a cheap
                         rule (the point is the step's cost, not learning)

and returns the RL overrides that point the config at them (model.hf_dir, task.path).
Everything is seeded: the same shape gives the same tokenizer, weights and prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mcore_rl.config import ConfigError
from mcore_rl.models.spec import ModelSpec
from mcore_rl.tasks.tokenizer import load_tokenizer

PACKAGE = Path(__file__).resolve().parents[1]
BENCH_CONFIGS = PACKAGE.parent / "configs" / "bench"
EOS = "<|endoftext|>"
PROMPTS = 256


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """spec: the model (its vocab is replaced by the tokenizer's size); vocab: BPE pieces;
    prompt_tokens: every prompt's length; config: the RL YAML of the step's settings."""

    spec: ModelSpec
    vocab: int
    prompt_tokens: int
    config: Path


SHAPES: dict[str, StepShape] = {
    # Qwen2.5-0.5B's layout scaled down (GQA 2 kv heads, head_dim 64, ffn 4x, q/k/v biases,
    # untied output layer), 4 layers of hidden 256, a 16k BPE vocabulary: ~12 M parameters,
    # 8.4 M of them in the embedding and output layers, as in small real checkpoints where
    # the vocabulary dominates. 64-token prompts, 128-token responses.
    "qwen2_16k": StepShape(
        spec=ModelSpec(family="qwen2", architecture="Qwen2ForCausalLM", hidden=256, ffn=1024,
                       heads=4, kv_heads=2, head_dim=64, layers=4, vocab=16384,
                       qkv_bias=True, max_positions=1024, rope_theta=1e6, norm_eps=1e-6),
        vocab=16384, prompt_tokens=64, config=BENCH_CONFIGS / "step_qwen2_16k.yaml"),
}


def get_shape(name: str) -> StepShape:
    if name not in SHAPES:
        raise ConfigError("shape", name, f"unknown shape; known: {', '.join(sorted(SHAPES))}")
    return SHAPES[name]


def shape_overrides(out: Path) -> tuple[str, ...]:
    """The RL overrides that point a shape's config at what `build_shape` wrote into `out`."""
    return (f"model.hf_dir={out / 'model'}", f"task.path={out / 'prompts.jsonl'}")


# Qwen2's pre-tokenizer split (its tokenizer.json): transformers loads a qwen2 checkpoint's
# tokenizer as Qwen2Tokenizer, which puts this split in front of the byte-level step whatever
# tokenizer.json says, so the BPE is trained with it too (then training and use agree).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# the repository's text, in path order: ~1.8 MB, enough for 16384 pieces
CORPUS_GLOBS = ("mcore_rl/**/*.py", "tests/**/*.py", "*.md", "configs/**/*.yaml")


def corpus() -> list[str]:
    """The text the tokenizer and prompts come from: this repository's source, tests, README
    and configs, file by file in path order (text the repository has; no download)."""
    root = PACKAGE.parent
    paths = sorted({p for pattern in CORPUS_GLOBS for p in root.glob(pattern)})
    return [p.read_text(encoding="utf-8") for p in paths]


def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE of `vocab` pieces (fewer if the text has too few pairs) trained on
    `texts` with Qwen2's split; EOS and padding `<|endoftext|>`, no BOS (prompts are encoded
    as they are)."""
    from transformers import PreTrainedTokenizerFast  # lazy: transformers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def fixed_length_prompts(tokenizer, texts: list[str], tokens: int, count: int) -> list[str]:
    """`count` windows of `texts` that encode to exactly `tokens` ids each (a window starts
    and ends on a token that begins a word, and is kept only if its decoded text re-encodes
    to the same length). Raises ValueError when the text has too few."""
    prompts: list[str] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = tokenizer.convert_ids_to_tokens(ids)
        starts = {i for i, p in enumerate(pieces) if p[:1] in ("Ġ", "Ċ")}
        i = 0
        while i + tokens < len(ids) and len(prompts) < count:
            if i in starts and i + tokens in starts:
                window = tokenizer.decode(ids[i:i + tokens]).strip()
                if len(tokenizer(window, add_special_tokens=False)["input_ids"]) == tokens:
                    prompts.append(window)
                    i += tokens
                    continue
            i += 1
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} prompts of {tokens} tokens in the corpus "
                     f"(wanted {count})")


def build_shape(name: str, out: Path, *, seed: int = 0) -> tuple[str, ...]:
    """Write shape `name`'s model, tokenizer and prompts into `out` (module doc); returns the
    RL overrides pointing at them (`shape_overrides`)."""
    from mcore_rl.models.hf_factory import make_hf_model_dir  # lazy: torch

    shape = get_shape(name)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    tok = train_tokenizer(texts, shape.vocab)
    model = make_hf_model_dir(shape.spec, out / "model", seed=seed, tokenizer_dir_or_obj=tok)
    # the prompts are measured with the tokenizer as the run loads it (both sides do)
    prompts = fixed_length_prompts(load_tokenizer(model), texts, shape.prompt_tokens, PROMPTS)
    with (out / "prompts.jsonl").open("w", encoding="utf-8") as f:
        for prompt in prompts:
            f.write(json.dumps({"question": prompt, "answer": ""}) + "\n")
    return shape_overrides(out)


def letter_share_reward(prompt: str, response: str, answer: str) -> float:
    """The share of the response's characters that are ASCII letters: a cheap rule whose
    values differ between a random model's samples (so every group has advantages)."""
    return sum(c.isascii() and c.isalpha() for c in response) / max(len(response), 1)


__all__ = ["SHAPES", "StepShape", "build_shape", "get_shape", "letter_share_reward",
           "shape_overrides"]
