"""One run directory, one run (`run.same_run`): resuming in a run directory with a config that
differs from its config.yaml in a field that shapes training is refused in one line naming the
fields with both values, before any worker starts and without overwriting anything; fields
that only say how long or where the run goes (`steps`, deadlines, checkpoint cadence, engine
count, ...) may change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config, to_dict, write_config
from mcore_rl.rl.checkpoint_dirs import CONTROLLER_FILE, MARKER
from mcore_rl.runconfig import RLConfig
from mcore_rl.run.same_run import (MAY_CHANGE_ON_RESUME, check_same_run, differences,
                                   may_change)

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

ROOT = Path(__file__).resolve().parents[2]
PPO, GRPO = ROOT / "configs" / "ppo_addition.yaml", ROOT / "configs" / "grpo_addition.yaml"


def saved_run(run_dir: Path, config: Path, *overrides: str, step: int = 3) -> Path:
    """RUN_DIR as a run of `config` leaves it: config.yaml and a complete checkpoint (its
    controller.json and marker; the shards do not matter before a worker starts)."""
    run_dir.mkdir(parents=True)
    write_config(load_config(RLConfig, config, list(overrides)), run_dir / "config.yaml")
    step_dir = run_dir / "checkpoints" / f"step_{step}"
    step_dir.mkdir(parents=True)
    (step_dir / CONTROLLER_FILE).write_text(json.dumps({"step": step, "layer_spec": "local"}))
    (step_dir / MARKER).write_text(json.dumps({"step": step}))
    return step_dir


def test_a_ppo_run_and_a_grpo_config_differ_in_the_fields_that_shape_training():
    ppo, grpo = (to_dict(load_config(RLConfig, path, [])) for path in (PPO, GRPO))
    found = {field: (old, new) for field, old, new in differences(ppo, grpo)}
    assert found["algorithm.advantage_estimator"] == ("gae", "grpo")
    assert found["algorithm.kl_coeff"] == (0.01, 0.0)
    assert found["actor.tp"] == (2, 1) and found["actor.dp"] == (1, 2)
    assert "steps" not in found and "rollout.engines" not in found  # 100 both; 1 vs 2: exempt
    assert ppo["rollout"]["engines"] != grpo["rollout"]["engines"]


def test_only_the_listed_fields_may_change():
    base = to_dict(load_config(RLConfig, GRPO, []))
    changed = to_dict(load_config(RLConfig, GRPO, [
        "steps=300", "checkpoint.every=7", "checkpoint.keep_last=1", "deadlines.gen_s=9",
        "rollout.engines=4", "recovery.max_engine_restarts=0", "sync.backend=gloo",
        "rollout.enable_sleep=true", "sync.bucket_mb=8", "task.reward_errors=zero",
        "eval.every=0", "logging.wandb.project=p"]))
    assert differences(base, changed) == []
    for field in ("seed=1", "train.optimizer.lr=0.1", "max_new_tokens=6", "task.digits=3",
                  "rollout.tp=2", "temperature=0.5", "model.layers=3"):
        other = to_dict(load_config(RLConfig, GRPO, [field]))
        assert field.split("=")[0] in [d[0] for d in differences(base, other)], field
    assert may_change("checkpoint.every") and may_change("steps")
    assert not may_change("steps_per_epoch") and not may_change("rollout.tp")
    assert all(why for why in MAY_CHANGE_ON_RESUME.values())


def test_fields_that_only_one_side_has_are_not_compared():
    """A field added (or dropped) by another mcore-rl version between the two starts."""
    base = to_dict(load_config(RLConfig, GRPO, []))
    older = {k: v for k, v in base.items() if k != "min_new_tokens"}
    older["algorithm"] = {**base["algorithm"], "removed_since": 1}
    assert differences(older, base) == []


def test_the_refusal_names_each_field_with_both_values_and_how_to_start_fresh(tmp_path):
    step_dir = saved_run(tmp_path / "run", PPO)
    cfg = load_config(RLConfig, GRPO, ["task.reward_fn=mcore_rl.tasks.addition:digit_reward"])
    with pytest.raises(ConfigError) as err:
        check_same_run(tmp_path / "run", cfg, tmp_path / "run" / "config.yaml", step_dir)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"--out='{tmp_path / 'run'}': holds another run: resuming step_3")
    assert "algorithm.advantage_estimator 'gae' -> 'grpo'" in message
    assert "actor.tp 2 -> 1" in message and "more field(s)" in message  # 8 named, the rest counted
    assert "--resume never" in message and "another --out" in message
    # a long value is cut
    long = load_config(RLConfig, PPO, ["actor.lora.rank=8", "actor.lora.targets=[linear_qkv]"])
    with pytest.raises(ConfigError, match=r"actor.lora.targets \['linear_qkv', 'linear_proj', "
                                          r"'linear_f… -> \['linear_qkv'\]"):
        check_same_run(tmp_path / "run", long, tmp_path / "run" / "config.yaml", step_dir)
    # LoRA settings while LoRA is off in both runs shape nothing
    off = load_config(RLConfig, PPO, ["actor.lora.targets=[linear_qkv]", "actor.lora.lr=1e-3"])
    check_same_run(tmp_path / "run", off, tmp_path / "run" / "config.yaml", step_dir)
    # no saved config (a run from before it was written): nothing to compare
    check_same_run(tmp_path / "new", cfg, tmp_path / "new" / "config.yaml", step_dir)


def test_train_refuses_a_grpo_config_in_a_ppo_run_dir_before_any_worker(tmp_path):
    """The CLI: exit 2, one line naming the fields, config.yaml untouched, nothing built."""
    run = tmp_path / "run"
    saved_run(run, PPO)
    before = (run / "config.yaml").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", "train", str(GRPO), "--out",
                           str(run)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mcore-rl train: config error: --out="), \
        proc.stderr
    assert "algorithm.advantage_estimator 'gae' -> 'grpo'" in lines[0]
    assert "--resume never" in lines[0]
    assert (run / "config.yaml").read_bytes() == before
    names = {p.name for p in run.iterdir()}  # (logs/: the driver's log, opened first)
    assert names - {"logs"} == {"checkpoints", "config.yaml"}  # no model, stacks, metrics


def test_a_steps_increase_resumes(tmp_path, monkeypatch):
    """The same config with more steps passes the check and goes on to build the run (stopped
    there), resuming the run's checkpoint; its config.yaml then says the new steps."""
    from mcore_rl.run import lifecycle, train

    run = tmp_path / "run"
    step_dir = saved_run(run, ROOT / "configs" / "tiny_ci.yaml", "steps=3")

    class Built(Exception):
        pass

    def build(cfg, out):
        raise Built(train.start_point(out, "auto"))

    monkeypatch.setattr(lifecycle, "model_dir_while_ray_starts", build)
    cfg = load_config(RLConfig, ROOT / "configs" / "tiny_ci.yaml", ["steps=6"])
    with pytest.raises(Built) as built:
        train.run_rl(cfg, run)
    assert built.value.args[0] == step_dir
    assert load_config(RLConfig, run / "config.yaml", []).steps == 6
