"""Layer-spec checks before any worker starts: a checkpoint of one layer spec is refused by a
run of the other (naming `--resume`, both layer specs and the file that says so), and a run
that resolves the TE spec where TransformerEngine does not import is refused naming the field."""

import json
import subprocess
import sys

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.rl.checkpoint_dirs import check_resume
from mcore_rl.rl.checkpoint_dirs import MARKER


def fake_checkpoint(root, layer_spec=None, step=3):
    """What RLController.save_checkpoint writes (controller.json and, last, the completion
    marker; the shards do not matter)."""
    step_dir = root / "checkpoints" / f"step_{step}"
    step_dir.mkdir(parents=True)
    meta = {"step": step} if layer_spec is None else {"step": step, "layer_spec": layer_spec}
    (step_dir / "controller.json").write_text(json.dumps(meta))
    (step_dir / MARKER).write_text(json.dumps({"step": step}))
    return step_dir


def test_te_checkpoint_into_local_run_is_refused(tmp_path):
    fake_checkpoint(tmp_path, "te")
    with pytest.raises(ConfigError) as err:
        check_resume(tmp_path / "checkpoints", "local")
    assert err.value.field == "--resume"
    assert "saved by a run with layer_spec='te' (TransformerEngine layer spec" in str(err.value)
    assert "this run resolves layer_spec='local'" in str(err.value)
    assert "step_3/controller.json" in str(err.value)


def test_local_checkpoint_into_te_run_is_refused(tmp_path):
    fake_checkpoint(tmp_path, "local")
    with pytest.raises(ConfigError, match="layer_spec='local'.*this run resolves "
                                          "layer_spec='te'"):
        check_resume(tmp_path / "checkpoints", "te")


def test_same_spec_and_legacy_checkpoints_resume(tmp_path):
    step_dir = fake_checkpoint(tmp_path / "a", "local")
    assert check_resume(tmp_path / "a" / "checkpoints", "local") == step_dir
    legacy = fake_checkpoint(tmp_path / "b")  # written before the field existed: CPU runs
    assert check_resume(legacy, "local") == legacy
    with pytest.raises(ConfigError):
        check_resume(legacy, "te")


def test_converted_checkpoint_is_not_a_resume_point(tmp_path):
    (tmp_path / "mcore_rl_checkpoint.json").write_text("{}")
    with pytest.raises(ConfigError, match="HF->Megatron converted checkpoint"):
        check_resume(tmp_path, "local")


def test_train_cli_refuses_before_any_worker(tmp_path):
    """`mcore-rl train --resume DIR` on this CPU machine (layer_spec 'local') with a TE run's
    checkpoint: exit 2 with the reason, no worker started, no model built."""
    fake_checkpoint(tmp_path / "old", "te")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", "train", "--config",
                           "configs/grpo_addition.yaml", "--out", str(out), "--resume",
                           str(tmp_path / "old" / "checkpoints")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config error: --resume=" in proc.stderr
    assert "layer_spec='te'" in proc.stderr and "layer_spec='local'" in proc.stderr
    assert not (out / "stacks").exists() and not (out / "model").exists()


def test_te_run_without_transformer_engine_is_refused_before_workers(monkeypatch):
    """On a CUDA machine without TransformerEngine (like the GPU check machine) a local run
    resolves layer_spec 'te': refused with the field, not an ImportError in a worker."""
    import mcore_rl.models.gpt as gpt
    import mcore_rl.runconfig.resolve as resolve
    from mcore_rl.config import load_config
    from mcore_rl.run.train import check_layer_spec_here
    from mcore_rl.runconfig import RLConfig

    cfg = load_config(RLConfig, "configs/grpo_addition.yaml", [])
    check_layer_spec_here(cfg)  # this CPU machine: layer_spec 'local', nothing to refuse
    monkeypatch.setattr(resolve, "cuda_present", lambda: True)
    monkeypatch.setattr(resolve, "cuda_device_gib", lambda: 80.0)  # an H100, as it were
    monkeypatch.setattr(gpt, "te_importable", lambda: False)
    with pytest.raises(ConfigError, match="cluster.device='local': runs on this machine's "
                                          "CUDA, so the resolved layer_spec is 'te', but "
                                          "TransformerEngine"):
        check_layer_spec_here(cfg)
    monkeypatch.setattr(gpt, "te_importable", lambda: True)
    check_layer_spec_here(cfg)
