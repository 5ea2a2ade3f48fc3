"""Issue #29: your own model and your own data. `configs/grpo_jsonl.yaml` runs end to end on a
small random Qwen2 with a BPE tokenizer and a chat template (built here, no download), and
every step trains on the tokens it sampled."""

import json
import subprocess
import sys

from tests.support.user_model import ROOT, WORD_PROBLEMS, make_user_model


def test_grpo_jsonl_trains_a_user_model_on_jsonl_data(tmp_path):
    model_dir = make_user_model(tmp_path / "user_model")
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train", "--config",
         str(ROOT / "configs" / "grpo_jsonl.yaml"), "--out", str(run),
         f"model.hf_dir={model_dir}", f"task.path={WORD_PROBLEMS}",
         "task.reward_fn=tests.support.user_model:digit_reward",
         # the word problems are 45-63 tokens in this tokenizer's chat template
         "max_prompt_tokens=64", "max_new_tokens=48", "steps=3", "prompts_per_step=4",
         "samples_per_prompt=4", "train.optimizer.lr=1e-4", "checkpoint.every=0",
         "rollout.kv_cache_gib=0.125"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["loss_tokens"] == row["response_tokens"] > 0, row
        assert row["grad_norm"] > 0, row
        assert row["prompts/filtered_overlong"] == 0
