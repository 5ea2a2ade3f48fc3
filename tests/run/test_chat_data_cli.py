"""Issue #43: a chat-format dataset's malformed line is refused when the file is read, so
`mcore-rl preflight` lists it (one line naming the file, the line and the key) and
`mcore-rl train` exits 2 before any worker starts, without a traceback; a chat prompt with a
tokenizer that has no chat template is one line naming the tokenizer and the file."""

from __future__ import annotations

import json
import subprocess
import sys

from mcore_rl.cli import main
from tests.support.user_model import ROOT

SYSTEM = {"role": "system", "content": "Be brief."}


def _model_dir(path, tokenizer: bool):
    """config.json (enough to size the run), with the addition task's sentencepiece tokenizer
    (no chat template) when `tokenizer`."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 300, "max_position_embeddings": 512}))
    if tokenizer:
        from mcore_rl.tasks.tokenizer import build_tokenizer_dir

        build_tokenizer_dir(path)
    return path


def _data(path, second):
    path.write_text(json.dumps({"messages": [SYSTEM, {"role": "user", "content": "2+2="}],
                                "answer": 4}) + "\n" + json.dumps(second) + "\n")
    return path


ARGS = ["task.prompt_key=messages", "max_prompt_tokens=64", "max_new_tokens=64"]


def test_preflight_lists_a_malformed_line_and_a_tokenizer_without_a_template(tmp_path, capsys):
    config = str(ROOT / "configs" / "grpo_jsonl.yaml")
    model = _model_dir(tmp_path / "m", tokenizer=True)
    bad = _data(tmp_path / "bad.jsonl", {"messages": [{"role": "user", "content": 7}],
                                        "answer": "4"})
    assert main(["preflight", config, f"model.hf_dir={model}", f"task.path={bad}", *ARGS]) == 2
    out = capsys.readouterr().out
    assert (f"ERROR [dataset] task.prompt_key='messages' (task.path): {bad}:2: 'messages' "
            "message 0 (user) has content that is a number (7): expected text\n") in out
    good = _data(tmp_path / "good.jsonl", {"messages": "3+4=", "answer": "7"})
    assert main(["preflight", config, f"model.hf_dir={model}", f"task.path={good}", *ARGS]) == 2
    out = capsys.readouterr().out
    assert (f"ERROR [prompt-length] task.path={good}: the prompts are chat messages but the "
            f"tokenizer (LlamaTokenizer, {model}) has no chat template\n      fix: text prompts, "
            "or model.hf_dir with a tokenizer that has a chat template\n") in out


def test_train_refuses_a_null_prompt_before_any_worker(tmp_path):
    model = _model_dir(tmp_path / "m", tokenizer=False)
    bad = _data(tmp_path / "bad.jsonl", {"messages": None, "answer": "4"})
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train", str(ROOT / "configs" / "grpo_jsonl.yaml"),
         "--out", str(tmp_path / "run"), f"model.hf_dir={model}", f"task.path={bad}", *ARGS],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"ERROR [dataset] task.prompt_key='messages' (task.path): {bad}:2: 'messages' is "
            "null: expected the prompt text or a list of chat messages") in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "stacks").exists()
