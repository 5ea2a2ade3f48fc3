"""A run's checkpoint (model and optimizer, `role_checkpoint.save_role` at TP2: what
RUN_DIR/checkpoints/step_<k>/actor holds) converts and verifies: `convert mcore-to-hf --verify`
loads its model weights only (not the optimizer's state) and compares the logits. The output
appears at DST only once verified: a failed or broken verification removes it, says so in one
line and leaves an earlier DST as it was. `mcore-rl export RUN_DIR OUT` finds the checkpoint
and the model's config and tokenizer from the run directory alone (tests/run/test_survive.py
exports a real run's)."""

from __future__ import annotations

import json

import pytest

from mcore_rl.cli import main as mcore_rl_main
from mcore_rl.conversion import verify
from tests.support.run_checkpoint import fake_run_dir, save_trained_actor
from tools.checkpoint_convert.cli import main

from .helpers import assert_bit_exact, hf_tensors


@pytest.fixture(scope="module")
def run_ckpt(hf_dirs, tmp_path_factory):
    """(the HF model it started from, the actor checkpoint after one update at TP2)."""
    hf = hf_dirs["llama_gqa"]
    return hf, save_trained_actor(hf, tmp_path_factory.mktemp("run_ckpt") / "actor", tp=2)


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_verify_on_a_run_checkpoint_compares_the_model_weights(run_ckpt, tmp_path, capsys):
    hf, ckpt = run_ckpt
    code = main(["mcore-to-hf", str(ckpt), str(tmp_path / "hf"), "--hf-config", str(hf),
                 "--verify", "--verify-tp", "2", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["verify"]["ok"] and summary["verify"]["max_abs_diff"] <= 1e-5
    assert summary["dst"] == str(tmp_path / "hf")
    assert _leftovers(tmp_path) == []
    trained, start = hf_tensors(tmp_path / "hf"), hf_tensors(hf)
    assert trained.keys() == start.keys()
    assert any(not (trained[k] == start[k]).all() for k in start)  # the updated weights


@pytest.mark.parametrize("failure", ["logits differ", "check broke"])
def test_a_failed_verification_leaves_no_output(run_ckpt, tmp_path, capsys, monkeypatch,
                                                failure):
    """The conversion is fine; the check is not (its logits, or the check itself): nothing
    appears at DST, an existing DST (--force) keeps its old files, one line says why."""
    hf, ckpt = run_ckpt

    def fake_verify(hf_dir, ckpt_dir, spec, parallel, **kwargs):
        assert hf_dir != tmp_path / "hf" and (hf_dir / "config.json").is_file()  # staged
        if failure == "check broke":
            raise RuntimeError("ranks [1] failed:\n--- rank 1 ---\nprocess died with exit "
                               "code 9")
        return verify.VerifyReport(0.5, 2.0, 3, 16, "TP1·PP1")

    monkeypatch.setattr(verify, "verify_conversion", fake_verify)
    args = ["mcore-to-hf", str(ckpt), str(tmp_path / "hf"), "--hf-config", str(hf),
            "--verify", "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    want = ("verification FAILED: max |logit diff| 5.000e-01 > --verify-atol 0.001"
            if failure == "logits differ" else
            "verification could not run: process died with exit code 9")
    assert err[-1] == (f"mcore-rl convert mcore-to-hf: {want}; nothing written at "
                       f"{tmp_path / 'hf'}"), err
    assert not (tmp_path / "hf").exists() and _leftovers(tmp_path) == []

    (tmp_path / "hf").mkdir()  # an earlier output stays as it was
    (tmp_path / "hf" / "old.txt").write_text("old")
    assert main([*args, "--force"]) == 1
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["old.txt"]
    assert _leftovers(tmp_path) == []


def test_export_finds_the_checkpoint_config_and_tokenizer_from_the_run_dir(run_ckpt, tmp_path,
                                                                           capsys):
    """model.hf_dir from RUN_DIR/config.yaml; the newest complete checkpoint by default (an
    older one with --step), its actor/ converted: the same files convert writes."""
    hf, ckpt = run_ckpt
    run = tmp_path / "run"
    fake_run_dir(run, ckpt, step=4, overrides=(f"model.hf_dir={hf}",))
    fake_run_dir(run, ckpt, step=2, overrides=(f"model.hf_dir={hf}",))
    (run / "checkpoints" / ".step_6.tmp").mkdir()  # a save cut off: not a checkpoint
    assert mcore_rl_main(["export", str(run), str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith(f"exported step_4 of {run}: mcore-to-hf: 39 tensors")
    assert json.loads(out[-1])["src"] == str(run / "checkpoints" / "step_4" / "actor")
    assert main(["mcore-to-hf", str(ckpt), str(tmp_path / "ref"), "--hf-config",
                 str(hf), "--no-progress"]) == 0
    assert assert_bit_exact(tmp_path / "ref", tmp_path / "out") == 39
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    assert mcore_rl_main(["export", str(run), str(tmp_path / "two"), "--step", "2",
                          "--no-progress"]) == 0
    assert "exported step_2 of" in capsys.readouterr().out
    assert _leftovers(tmp_path) == []


def test_export_of_a_demo_run_takes_the_model_it_built(run_ckpt, tmp_path, capsys):
    """model.hf_dir null: the config and tokenizer of RUN_DIR/model, the demo model the run
    built (here: the HF model the checkpoint came from, put where the run puts it)."""
    import shutil

    hf, ckpt = run_ckpt
    run = tmp_path / "run"
    fake_run_dir(run, ckpt)
    shutil.copytree(hf, run / "model")
    assert mcore_rl_main(["export", str(run), str(tmp_path / "out"), "--no-progress"]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == \
        (hf / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("case,message", [
    ("no run", "{run}: not a run directory (no config.yaml: `mcore-rl train --out RUN_DIR` "
               "writes it)"),
    ("no checkpoint", "{run}: no complete checkpoint in {run}/checkpoints (a run writes one "
                      "after its last step and every checkpoint.every steps)"),
    ("no step", "--step 9: {run}/checkpoints/step_9 is not a complete checkpoint (complete "
                "steps: 3)"),
    ("no model", "{run}/model: no config.json; the model's config and tokenizer come from "
                 "the demo model the run built ({run}/config.yaml has model.hf_dir null)"),
    ("out exists", "destination {out} already exists (pass --force to replace it)"),
])
def test_export_refuses_in_one_line(run_ckpt, tmp_path, capsys, case, message):
    hf, ckpt = run_ckpt
    run, out = tmp_path / "run", tmp_path / "out"
    if case == "no run":
        run.mkdir()
    else:
        fake_run_dir(run, ckpt, overrides=() if case == "no model" else
                     (f"model.hf_dir={hf}",))
    if case == "no checkpoint":
        import shutil

        shutil.rmtree(run / "checkpoints")
    if case == "out exists":
        out.mkdir()
    argv = ["export", str(run), str(out), "--no-progress"] + (
        ["--step", "9"] if case == "no step" else [])
    assert mcore_rl_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mcore-rl export: {message.format(run=run, out=out)}"]
    assert not (out / "config.json").exists()
