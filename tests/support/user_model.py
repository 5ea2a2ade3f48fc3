"""A user's model, built in the test: a small random Qwen2 with a byte-level BPE tokenizer
trained on the word problems and a ChatML chat template (no download)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORD_PROBLEMS = ROOT / "configs" / "data" / "word_problems.jsonl"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bpe_chat_tokenizer(texts: list[str], vocab_size: int = 384):
    """A byte-level BPE trained on `texts`, with ChatML's special tokens and template;
    EOS is `<|im_end|>` (the end of a turn), padding `<|endoftext|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


def make_user_model(out: Path, *, seed: int = 0) -> Path:
    """A 2-layer Qwen2 (hidden 64, 2 heads of 32, 1 kv head) saved as an HF checkpoint
    directory with its tokenizer, as a user's own model would be."""
    from mcore_rl.models.hf_factory import make_hf_model_dir
    from mcore_rl.models.spec import ModelSpec

    rows = [json.loads(line) for line in WORD_PROBLEMS.read_text().splitlines() if line.strip()]
    tok = bpe_chat_tokenizer([r["question"] + "\n" + r["answer"] for r in rows])
    spec = ModelSpec(family="qwen2", architecture="Qwen2ForCausalLM", hidden=64, ffn=128,
                     heads=2, kv_heads=1, head_dim=32, layers=2, vocab=len(tok),
                     qkv_bias=True, max_positions=512, rope_theta=10000.0, norm_eps=1e-6)
    return make_hf_model_dir(spec, out, seed=seed, tokenizer_dir_or_obj=tok)


def digit_reward(prompt: str, response: str, answer: str) -> float:
    """The share of the response's characters that are digits: a reward a random model's
    samples differ on, so every GRPO group has an advantage to train on."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
