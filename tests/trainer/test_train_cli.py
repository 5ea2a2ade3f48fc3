"""`mcore-rl train` refuses a broken config before any worker starts: a bad value at load
(named field), and a combination only the preflight sees (every problem listed)."""

import subprocess
import sys
import time


def run_train(tmp_path, *overrides):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", "train", "--config",
                           "configs/grpo_addition.yaml", "--out", str(tmp_path), *overrides],
                          capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


def test_preflight_stops_a_bad_run_before_any_worker(tmp_path):
    proc, elapsed = run_train(tmp_path, "rollout.tp=3", "actor.tp=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rollout: vLLM tp=3 does not divide num_attention_heads=4" in proc.stdout
    assert "parallel.tp=4: does not divide num_key_value_heads=2" in proc.stdout
    assert "fix:" in proc.stdout
    assert not (tmp_path / "stacks").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_bad_value_names_the_field(tmp_path):
    proc, _ = run_train(tmp_path, "updates_per_batch=3")
    assert proc.returncode == 2
    assert "updates_per_batch=3: must divide prompts_per_step*samples_per_prompt=256" \
        in proc.stdout
