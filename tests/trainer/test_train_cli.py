"""`mcore-rl train` refuses a broken config before any worker starts: a bad value at load
(named field), a combination only the preflight sees (every problem listed, named as in the
config), and a GPU config whose checkpoint is not on this machine (checked, then refused)."""

import subprocess
import sys
import time


def run_train(tmp_path, *overrides, config="configs/grpo_addition.yaml"):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", "train", "--config",
                           config, "--out", str(tmp_path), *overrides],
                          capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


def test_preflight_stops_a_bad_run_before_any_worker(tmp_path):
    proc, _ = run_train(tmp_path, "rollout.tp=3", "actor.tp=4")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rollout: vLLM tp=3 does not divide num_attention_heads=4" in proc.stdout
    assert "actor.tp=4: does not divide num_key_value_heads=2" in proc.stdout
    assert "fix: actor.tp one of 1, 2" in proc.stdout
    assert not (tmp_path / "stacks").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "model").exists()  # refused before the demo model is built


def test_bad_value_names_the_field(tmp_path):
    proc, _ = run_train(tmp_path, "updates_per_batch=3")
    assert proc.returncode == 2
    assert "updates_per_batch=3: must divide prompts_per_step*samples_per_prompt=256" \
        in proc.stdout


def test_gpu_config_passes_preflight_then_needs_its_checkpoint(tmp_path):
    proc, _ = run_train(tmp_path, config="configs/gpu/llama3-8b.yaml")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "preflight" not in proc.stdout  # sized for its 8 GPUs: no problem, no warning
    assert "model.hf_dir='/models/Meta-Llama-3-8B-Instruct': expected an HF checkpoint " \
           "directory" in proc.stdout
