"""Issue #29: your own model and your own data. `configs/grpo_jsonl.yaml` runs end to end on a
small random Qwen2 with a BPE tokenizer and a chat template (built here, no download), and
every step trains on the tokens it sampled.

Issue #43: the data is chat-format (a list of messages with a system turn, as verl, TRL and
NeMo-RL read it) and the reward is a file named by its path: every prompt the reward receives
is exactly the tokenizer's `apply_chat_template(messages, add_generation_prompt=True,
tokenize=False)` of a line of the file (the reward raises otherwise, which stops the run).

It is also the suite's `mcore-rl train` on a checkpoint the run is given (not the demo model)
with sequence packing (`train.max_tokens_per_micro_batch`): what test_train_cli.py's own JSONL
run on the demo model's export checked (the math reward it used is tests/tasks/test_math.py's,
a reward named by module path is test_survive.py's) is asserted here."""

import json
import subprocess
import sys
import textwrap

from tests.support.user_model import ROOT, WORD_PROBLEMS, make_user_model

# a reward file the config names by path: it checks every prompt against the rendered template
CHECKED_REWARD = textwrap.dedent("""
    import json
    from transformers import AutoTokenizer

    TOK = AutoTokenizer.from_pretrained({model!r}, local_files_only=True)
    RENDERED = {{TOK.apply_chat_template(json.loads(line)["messages"],
                                         add_generation_prompt=True, tokenize=False)
                for line in open({data!r}) if line.strip()}}

    def digit_reward(prompt, response, answer):
        if prompt not in RENDERED:
            raise ValueError(f"not a rendered chat template of the data: {{prompt!r}}")
        with open({seen!r}, "a") as f:
            f.write(json.dumps(prompt) + "\\n")
        return sum(c.isdigit() for c in response) / max(len(response), 1)
""")


def test_grpo_jsonl_trains_a_user_model_on_jsonl_data(tmp_path):
    model_dir = make_user_model(tmp_path / "user_model")
    data, seen = tmp_path / "chat.jsonl", tmp_path / "seen.jsonl"
    with data.open("w") as f:
        for line in WORD_PROBLEMS.read_text().splitlines():
            row = json.loads(line)
            f.write(json.dumps({"messages": [{"role": "system", "content": "Solve it."},
                                             {"role": "user", "content": row["question"]}],
                                "answer": row["answer"]}) + "\n")
    reward = tmp_path / "rewards.py"
    reward.write_text(CHECKED_REWARD.format(model=str(model_dir), data=str(data),
                                            seen=str(seen)))
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train", "--config",
         str(ROOT / "configs" / "grpo_jsonl.yaml"), "--out", str(run),
         f"model.hf_dir={model_dir}", f"task.path={data}", "task.prompt_key=messages",
         f"task.reward_fn={reward}:digit_reward",
         # the word problems are 59-77 tokens in this tokenizer's chat template
         "max_prompt_tokens=80", "max_new_tokens=48", "steps=3", "prompts_per_step=4",
         "samples_per_prompt=4", "train.optimizer.lr=1e-4", "checkpoint.every=0",
         "rollout.kv_cache_gib=0.125",
         # packed micro batches: one row of whole sequences (<= 128 tokens each) up to 256
         "train.max_tokens_per_micro_batch=256"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train done in " in proc.stdout and "demo done" not in proc.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert 0 <= row["reward_mean"] <= 1 and row["micro_batches"] >= 1, row
        assert row["loss_tokens"] == row["response_tokens"] > 0, row
        assert row["grad_norm"] > 0, row
        assert row["prompts/filtered_overlong"] == 0
        assert row["reward/errors"] == 0
    prompts = [json.loads(line) for line in seen.open()]
    assert len(prompts) >= 3 * 4 * 4  # every sample of every step, each checked
    assert all(p.startswith("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n")
               and p.endswith("<|im_start|>assistant\n") for p in prompts)
    assert not (run / "model").exists()  # trained the given checkpoint, built no demo model
