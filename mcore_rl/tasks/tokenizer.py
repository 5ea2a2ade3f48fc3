"""A sentencepiece BPE trained offline on a task's own text, wrapped as an HF tokenizer.

For the addition task it ends at 16 pieces — `<unk> <s> </s> <pad>`, the 10 digits, `+`, `=` —
one token per character: `"37+05="` → `[BOS, 3, 7, +, 0, 5, =]` (7 ids), answer `"042"` + EOS
→ 4 ids. Special ids are fixed: unk 0, bos 1, eos 2, pad 3.

Deterministic: the corpus is drawn from a seeded generator, training is single-threaded and
reads every line (no sampling), so the same arguments give the same `tokenizer.model` bytes.

`build_tokenizer_dir` writes `tokenizer.model` (sentencepiece, e.g. for Megatron) beside the
HF files (`tokenizer.json`, `tokenizer_config.json`) that `AutoTokenizer` and vLLM load
offline. In transformers 5 `LlamaTokenizer` is the `tokenizers`-backed class; `from_pretrained`
on a folder holding only `tokenizer.model` converts it.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import sentencepiece as spm

from mcore_rl.tasks.addition import EOS_TEXT, AdditionTask
from mcore_rl.tasks.base import Prompt, chat_dicts

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
UNK, BOS, EOS, PAD = "<unk>", "<s>", EOS_TEXT, "<pad>"
SPM_FILE = "tokenizer.model"


def train_sentencepiece(task: AdditionTask | None = None, *, vocab_size: int = 16,
                        corpus_lines: int = 2000, seed: int = 0) -> bytes:
    """Train a BPE sentencepiece model on `task.corpus(corpus_lines, seed=seed)` (any task
    with a `corpus`; its `user_symbols`, if any, become single pieces); returns
    the serialized `tokenizer.model`. `vocab_size` is a soft limit (`hard_vocab_limit=False`):
    the model never has fewer pieces than the corpus's characters + 4 specials."""
    task = task or AdditionTask()
    lines = task.corpus(corpus_lines, seed=seed)
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe",
        vocab_size=vocab_size, hard_vocab_limit=False, split_digits=True,
        add_dummy_prefix=False, character_coverage=1.0, byte_fallback=False,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        # e.g. the tool task's tags: always one piece each
        user_defined_symbols=list(getattr(task, "user_symbols", ())),
        num_threads=1, input_sentence_size=0, minloglevel=2,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        unk_piece=UNK, bos_piece=BOS, eos_piece=EOS, pad_piece=PAD)
    return out.getvalue()


def hf_tokenizer_from_spm(model: bytes | str | Path):
    """Wrap a sentencepiece model (bytes or path of a `tokenizer.model`) as an HF
    `LlamaTokenizer` that adds BOS (not EOS), pads with `<pad>` and adds no dummy prefix."""
    from transformers import LlamaTokenizer  # lazy: transformers

    data = model if isinstance(model, bytes) else Path(model).read_bytes()
    with tempfile.TemporaryDirectory(prefix="mcore_rl_spm_") as tmp:
        (Path(tmp) / SPM_FILE).write_bytes(data)
        tok = LlamaTokenizer.from_pretrained(
            tmp, local_files_only=True, add_prefix_space=False, legacy=False,
            add_bos_token=True, add_eos_token=False,
            unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    got = (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    if got != (UNK_ID, BOS_ID, EOS_ID, PAD_ID):
        raise RuntimeError(f"special ids (unk, bos, eos, pad) = {got}: expected "
                           f"{(UNK_ID, BOS_ID, EOS_ID, PAD_ID)}")
    return tok


def build_tokenizer_dir(out_dir: str | Path, task: AdditionTask | None = None, *,
                        vocab_size: int = 16, seed: int = 0) -> Path:
    """Train and write a tokenizer folder (`tokenizer.model` + HF files); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = train_sentencepiece(task, vocab_size=vocab_size, seed=seed)
    (out / SPM_FILE).write_bytes(data)
    hf_tokenizer_from_spm(data).save_pretrained(out)
    return out


def load_tokenizer(path: str | Path):
    """`AutoTokenizer` from a local folder, offline."""
    from transformers import AutoTokenizer  # lazy: transformers

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def save_tokenizer(tokenizer_dir_or_obj, out_dir: str | Path):
    """Save a tokenizer (object or folder) into `out_dir`, carrying `tokenizer.model` along
    when the source folder has one. Returns the tokenizer object."""
    if isinstance(tokenizer_dir_or_obj, (str, Path)):
        src = Path(tokenizer_dir_or_obj)
        tok = load_tokenizer(src)
        tok.save_pretrained(out_dir)
        if (src / SPM_FILE).is_file() and src.resolve() != Path(out_dir).resolve():
            shutil.copyfile(src / SPM_FILE, Path(out_dir) / SPM_FILE)
        return tok
    tokenizer_dir_or_obj.save_pretrained(out_dir)
    return tokenizer_dir_or_obj


def encode_prompt(tokenizer, prompt: Prompt, *, chat_template: bool = False) -> list[int]:
    """Prompt ids as the engines see them. Text: the tokenizer's special tokens (BOS) + the
    text's ids (addition: one id per character). A chat (messages), or text with
    `chat_template` (one user turn): the ids of `prompt_texts`' rendering, special tokens as
    the template writes them (none added: `apply_chat_template(..., tokenize=True)`'s ids)."""
    return encode_prompts(tokenizer, [prompt], chat_template=chat_template)[0]


def templated(prompt: Prompt, chat_template: bool) -> bool:
    """Whether `prompt` goes through the tokenizer's chat template: a chat always; text with
    `chat_template`."""
    return chat_template or not isinstance(prompt, str)


def prompt_texts(tokenizer, prompts: Sequence[Prompt], *,
                 chat_template: bool = False) -> list[str]:
    """Each prompt as text, as the reward function receives it and the engines' ids encode
    it: a chat → `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    tokenize=False)`, system turns and all; text with `chat_template` → the same rendering
    of one user turn; other text → itself. Raises ValueError (naming the tokenizer) when a
    prompt needs a chat template the tokenizer lacks."""
    chats = [i for i, p in enumerate(prompts) if templated(p, chat_template)]
    out = list(prompts)
    if chats:
        if not getattr(tokenizer, "chat_template", None):
            what = ("the prompts are chat messages" if any(not isinstance(p, str)
                                                           for p in prompts)
                    else "task.chat_template=true")
            raise ValueError(f"{what} but the tokenizer ({type(tokenizer).__name__}, "
                             f"{tokenizer.name_or_path}) has no chat template")
        rendered = tokenizer.apply_chat_template(
            [[{"role": "user", "content": prompts[i]}] if isinstance(prompts[i], str)
             else chat_dicts(prompts[i]) for i in chats],
            add_generation_prompt=True, tokenize=False)
        for i, text in zip(chats, rendered):
            out[i] = text
    return out


def encode_prompts(tokenizer, prompts: Sequence[Prompt], *,
                   chat_template: bool = False) -> list[list[int]]:
    """`encode_prompt` of each prompt, in one rendering and one tokenizer call (a call per
    text pays transformers' Python overhead once per text: most of a warm-up batch's
    encoding time)."""
    if not prompts:
        return []
    texts = prompt_texts(tokenizer, prompts, chat_template=chat_template)
    ids: list[list[int] | None] = [None] * len(texts)
    for special in (True, False):  # plain text gets BOS; a rendered template has its own
        rows = [i for i, p in enumerate(prompts) if templated(p, chat_template) != special]
        if rows:
            encoded = tokenizer([texts[i] for i in rows], add_special_tokens=special)
            for i, row in zip(rows, encoded["input_ids"]):
                ids[i] = list(row)
    return ids


def encode_answer(tokenizer, answer_text: str) -> list[int]:
    """Target ids for supervised warm-up: the answer's ids + EOS (no BOS)."""
    return encode_answers(tokenizer, [answer_text])[0]


def encode_answers(tokenizer, answer_texts: Sequence[str]) -> list[list[int]]:
    """`encode_answer` of each text, in one tokenizer call."""
    if not answer_texts:
        return []
    ids = tokenizer(list(answer_texts), add_special_tokens=False)["input_ids"]
    return [list(row) + [tokenizer.eos_token_id] for row in ids]


def response_text(token_ids: Sequence[int], tokenizer) -> str:
    """The text a reward function sees for generated `token_ids` (response only, no prompt):
    the decoded tokens up to the first EOS, then `EOS_TEXT` if there was an EOS; whatever
    follows the first EOS (e.g. padding) is not part of the response. Other special tokens
    before the EOS stay in the text (as `<pad>`, `<s>`, ...), so they cost the reward."""
    ids = list(token_ids)
    eos = tokenizer.eos_token_id
    if eos in ids:
        return tokenizer.decode(ids[:ids.index(eos)], skip_special_tokens=False) + EOS_TEXT
    return tokenizer.decode(ids, skip_special_tokens=False)
