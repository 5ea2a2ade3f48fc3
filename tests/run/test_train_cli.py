"""`mcore-rl train` refuses a broken config before any worker starts, on stderr with exit 2
(`CONFIG_ERROR_EXIT`, as every command): a file that is not YAML (one line, file:line:col), a
bad value at load (named field), a combination only the preflight sees (every problem listed,
named as in the config), and a GPU config whose checkpoint is not on this machine. (A run
that trains on a given HF checkpoint and JSONL prompts is tests/run/test_grpo_jsonl.py's.)"""

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
    assert "rollout: vLLM tp=3 does not divide num_attention_heads=4" in proc.stderr
    assert "actor.tp=4: does not divide num_key_value_heads=2" in proc.stderr
    assert "fix: actor.tp one of 1, 2" in proc.stderr
    assert not (tmp_path / "stacks").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "model").exists()  # refused before the demo model is built


def test_train_refuses_devices_that_cannot_run_it(tmp_path):
    """Issue #12: nccl on a run that resolves to CPU, and a colocated placement with more
    engine ranks than devices — each named, exit 2, before any worker or model exists."""
    proc, _ = run_train(tmp_path, "cluster.device=cpu", "cluster.gpus_per_node=3",
                        "sync.backend=nccl", config="configs/tiny_ci.yaml")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "[sync-backend] sync.backend=nccl, but the run resolves to cpu" in proc.stderr
    proc, _ = run_train(tmp_path, "cluster.device=cpu", "cluster.placement=colocated",
                        "cluster.gpus_per_node=2", "rollout.enable_sleep=true",
                        "rollout.engines=3", config="configs/tiny_ci.yaml")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "[placement] cluster.placement=colocated: rollout.engines=3" in proc.stderr
    assert "fix: rollout.engines=2" in proc.stderr
    assert not (tmp_path / "stacks").exists() and not (tmp_path / "model").exists()


def test_bad_value_names_the_field(tmp_path):
    proc, _ = run_train(tmp_path, "updates_per_batch=3")
    assert proc.returncode == 2
    assert "updates_per_batch=3: must divide prompts_per_step*samples_per_prompt=256" \
        in proc.stderr


def _jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gpu_config_without_its_checkpoint_is_refused_by_preflight(tmp_path):
    """Sized for its 8 GPUs there is nothing wrong with it but the missing checkpoint, which
    preflight names (the run reads it here)."""
    data = _jsonl(tmp_path / "gsm8k.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    proc, _ = run_train(tmp_path / "run", f"task.path={data}", f"task.heldout_path={data}",
                        config="configs/gpu/llama3-8b.yaml")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "1 error(s)" in proc.stderr
    assert "ERROR [model-dir] model.hf_dir=/models/Meta-Llama-3-8B-Instruct: no such " \
           "directory on this machine" in proc.stderr


def _model_config_only(path):
    """An HF model directory with only config.json: enough for preflight to size the run
    (the weights are looked for after it)."""
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 300, "max_position_embeddings": 512}))
    return path


def test_dataset_problems_stop_train_before_any_worker(tmp_path):
    """Issue #18: a missing JSONL file or key is a preflight problem naming the task field
    (exit 2, the file and line in the message), not a traceback from a worker."""
    model = _model_config_only(tmp_path / "m")
    jsonl = [f"model.hf_dir={model}", "task.kind=jsonl", "warmup.max_steps=0"]
    missing = tmp_path / "nope.jsonl"
    proc, _ = run_train(tmp_path / "run", *jsonl, f"task.path={missing}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"ERROR [dataset] task.path: {missing}: no such file" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    data = _jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"},
                                          {"prompt": "2+2?", "answer": "4"}])
    proc, _ = run_train(tmp_path / "run", *jsonl, f"task.path={data}",
                        f"task.heldout_path={missing}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"ERROR [dataset] task.prompt_key='question' (task.path): {data}:2: missing key "
            "'question' (has: answer, prompt)") in proc.stderr
    assert f"ERROR [dataset] task.heldout_path: {missing}: no such file" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "stacks").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_yaml_syntax_error_is_one_line_on_stderr(tmp_path):
    """A config that is not YAML: one line `file:line:col: problem`, no traceback, exit 2 —
    for `train` and `demo --config` alike."""
    bad = tmp_path / "run.yaml"
    bad.write_text("model:\n  preset: tiny\n actor: [\n")
    for command in ("train", "demo"):
        proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", command, "--config",
                               str(bad), "--out", str(tmp_path / "run")],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == ""
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"mcore-rl {command}: config error: {bad}:3:2: expected "), line
        assert not (tmp_path / "run").exists()
