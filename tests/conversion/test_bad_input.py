"""Bad input is refused with a message that says what and where, before anything appears at
the destination; a failure or Ctrl-C mid-write leaves no partial output (and, with --force,
the previous output intact). Runs the CLI in-process (`main(argv)` → exit code)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mcore_rl.conversion import convert as convert_mod
from mcore_rl.conversion.convert import hf_to_mcore
from mcore_rl.conversion.verify import VerifyReport
from tools.checkpoint_convert.cli import main

from .helpers import hf_tensors

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def _copy_with(src: Path, dst: Path, mutate=None, config=None) -> Path:
    """Copy an HF folder into one model.safetensors, after `mutate(tensors)` / `config(cfg)`."""
    dst.mkdir()
    for p in src.iterdir():
        if p.suffix != ".safetensors" and not p.name.endswith(".index.json"):
            shutil.copyfile(p, dst / p.name)
    tensors = hf_tensors(src)
    if mutate:
        mutate(tensors)
    save_file(tensors, dst / "model.safetensors")
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv] + ["--no-progress"])
    return code, capsys.readouterr().err


def _nothing_written(dst: Path) -> bool:
    return not dst.exists() and not list(dst.parent.glob(f".{dst.name}.partial-*"))


@pytest.fixture
def src(hf_dirs):
    return hf_dirs["llama_gqa"]


@pytest.fixture(scope="module")
def ckpt(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "mc"
    hf_to_mcore(hf_dirs["llama_gqa"], out, progress=False)
    return out


def _del(name):
    return lambda t: t.pop(name)


@pytest.mark.parametrize("mutate, config, expected", [
    (None, lambda c: c.update(architectures=["GPT2LMHeadModel"]),
     "architectures=['GPT2LMHeadModel']: unsupported"),
    (_del("model.layers.3.mlp.up_proj.weight"), None,
     "1 tensor(s) the config implies are missing: model.layers.3.mlp.up_proj.weight"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}), None,
     "1 unexpected tensor(s), not part of a LlamaForCausalLM with this config: "
     "model.layers.0.mlp.extra.weight"),
    (lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 128)}), None,
     "tensor model.layers.1.self_attn.k_proj.weight has shape (32, 128), expected (64, 128)"),
], ids=["unknown_architecture", "missing_tensor", "extra_tensor", "wrong_shape"])
def test_bad_hf_source_is_refused(src, tmp_path, capsys, mutate, config, expected):
    bad = _copy_with(src, tmp_path / "bad", mutate, config)
    dst = tmp_path / "out"
    code, err = _run(capsys, "hf-to-mcore", bad, dst)
    assert code == 2 and expected in err, err
    assert _nothing_written(dst)


@pytest.mark.parametrize("mutate, config, expected", [
    # a router whose expert count disagrees with num_experts
    (lambda t: t.update({"model.layers.1.mlp.gate.weight": torch.zeros(3, 128)}), None,
     "tensor model.layers.1.mlp.gate.weight has shape (3, 128), expected (4, 128)"),
    # one expert's MLP not of moe_intermediate_size
    (lambda t: t.update({"model.layers.0.mlp.experts.2.up_proj.weight": torch.zeros(32, 128)}),
     None, "tensor model.layers.0.mlp.experts.2.up_proj.weight has shape (32, 128), expected "
           "(64, 128)"),
    (_del("model.layers.2.mlp.experts.3.down_proj.weight"), None,
     "1 tensor(s) the config implies are missing: model.layers.2.mlp.experts.3.down_proj.weight"),
    # config says 3 experts, the files hold 4 (and routers for 4)
    (None, lambda c: c.update(num_experts=3), "unexpected tensor(s), not part of a "
                                              "Qwen3MoeForCausalLM with this config"),
], ids=["router_shape", "expert_shape", "missing_expert", "fewer_experts_in_config"])
def test_bad_moe_source_is_refused(hf_dirs, tmp_path, capsys, mutate, config, expected):
    bad = _copy_with(hf_dirs["qwen3_moe"], tmp_path / "bad", mutate, config)
    code, err = _run(capsys, "hf-to-mcore", bad, tmp_path / "out")
    assert code == 2 and expected in err, err
    assert _nothing_written(tmp_path / "out")


def test_expert_parallel_that_does_not_divide_the_experts_is_refused(hf_dirs, tmp_path, capsys):
    code, err = _run(capsys, "hf-to-mcore", hf_dirs["qwen3_moe"], tmp_path / "out", "--verify",
                     "--verify-ep", "3")
    assert code == 2 and "--verify-ep=3: does not divide num_experts=4" in err, err
    code, err = _run(capsys, "hf-to-mcore", hf_dirs["qwen3_moe"], tmp_path / "out", "--verify",
                     "--verify-tp", "2", "--verify-etp", "3")
    assert code == 2 and "etp" in err, err
    assert _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("damage, expected", [
    (lambda b: b[:-1000], "incomplete metadata, file not fully covered"),   # data cut short
    (lambda b: b[:8] + b"#" * 16 + b[24:], "invalid JSON in header"),
    (lambda b: b[:5], "header too small"),
], ids=["truncated", "corrupt_header", "no_header"])
def test_damaged_safetensors_is_refused(src, tmp_path, capsys, damage, expected):
    bad = _copy_with(src, tmp_path / "bad")
    f = bad / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    code, err = _run(capsys, "hf-to-mcore", bad, tmp_path / "out")
    assert code == 2 and str(f) in err and expected in err, err
    assert _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("verb, args, expected", [
    ("hf-to-mcore", ["--verify-tp", "3"], "--verify-tp=3: does not divide num_attention_heads=4"),
    ("hf-to-mcore", ["--verify-tp", "4"], "--verify-tp=4: does not divide num_key_value_heads=2"),
    ("hf-to-mcore", ["--verify-pp", "3"],
     "--verify-pp=3: pp * vpp = 3 does not divide num_layers=4"),
    ("mcore-to-hf", ["--verify-pp", "2", "--verify-vpp", "4"], "does not divide num_layers=4"),
], ids=["tp_heads", "tp_kv_heads", "pp_layers", "vpp_layers"])
def test_verify_grid_that_does_not_divide_is_refused_before_converting(
        src, ckpt, tmp_path, capsys, verb, args, expected):
    source = src if verb == "hf-to-mcore" else ckpt
    code, err = _run(capsys, verb, source, tmp_path / "out", "--verify", *args)
    assert code == 2 and expected in err, err
    assert _nothing_written(tmp_path / "out")


def test_existing_output_is_refused_unless_force(src, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old-file").write_text("x")
    code, err = _run(capsys, "hf-to-mcore", src, dst)
    assert code == 2 and "already exists (pass --force" in err
    assert (dst / "old-file").exists()
    code, _ = _run(capsys, "hf-to-mcore", src, dst, "--force")
    assert code == 0 and not (dst / "old-file").exists() and (dst / ".metadata").is_file()
    assert not list(tmp_path.glob(".out.*"))          # no leftovers of the swap


@pytest.mark.parametrize("verb", ["hf-to-mcore", "mcore-to-hf"])
def test_source_equal_to_or_inside_destination_is_refused(src, ckpt, tmp_path, capsys, verb):
    source = src if verb == "hf-to-mcore" else ckpt
    code, err = _run(capsys, verb, source, source, "--force")
    assert code == 2 and "source and destination are the same path" in err
    code, err = _run(capsys, verb, source, source.parent, "--force")
    assert code == 2 and "contains the source" in err
    assert source.is_dir()


def test_bad_dist_checkpoint_is_refused(src, ckpt, hf_dirs, tmp_path, capsys):
    code, err = _run(capsys, "mcore-to-hf", src, tmp_path / "a")           # an HF folder
    assert code == 2 and "not a megatron-core torch_dist checkpoint (no .metadata)" in err
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("hf_config"))
    code, err = _run(capsys, "mcore-to-hf", bare, tmp_path / "b")
    assert code == 2 and "pass --hf-config" in err
    # A config the checkpoint does not match: a missing tensor (q/k/v bias) ...
    code, err = _run(capsys, "mcore-to-hf", ckpt, tmp_path / "c", "--hf-config",
                     hf_dirs["qwen2_tied_bias"])
    assert code == 2 and "missing tensor decoder.layers.self_attention.linear_qkv.bias" in err
    # ... and a wrong shape (5 layers for a 4-layer checkpoint), naming both shapes.
    five = _copy_with(src, tmp_path / "five", config=lambda c: c.update(num_hidden_layers=5))
    code, err = _run(capsys, "mcore-to-hf", ckpt, tmp_path / "d", "--hf-config", five)
    assert code == 2 and ("tensor decoder.layers.self_attention.linear_qkv.weight: expected "
                          "shape (5, 256, 128), found (4, 256, 128)") in err, err
    code, err = _run(capsys, "mcore-to-hf", ckpt, tmp_path / "e", "--max-shard-size", "lots")
    assert code == 2 and "--max-shard-size" in err
    assert all(_nothing_written(tmp_path / x) for x in "abcde")


def _fail_after(n: int, exc: type[BaseException], fn):
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > n:
            raise exc("injected failure")
        return fn(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("verb, target", [("hf-to-mcore", "materialize_rank"),
                                          ("mcore-to-hf", "write_tensor")])
def test_failure_mid_write_leaves_no_partial_output(src, ckpt, tmp_path, capsys, monkeypatch,
                                                    verb, target):
    source = src if verb == "hf-to-mcore" else ckpt
    original = getattr(convert_mod, target)
    # An error after a few tensors: raised, nothing at the destination.
    monkeypatch.setattr(convert_mod, target, _fail_after(5, RuntimeError, original))
    with pytest.raises(RuntimeError, match="injected failure"):
        main([verb, str(source), str(tmp_path / "out"), "--no-progress"])
    assert _nothing_written(tmp_path / "out")
    # Ctrl-C after a few tensors: exit 130, nothing at the destination.
    monkeypatch.setattr(convert_mod, target, _fail_after(5, KeyboardInterrupt, original))
    code, err = _run(capsys, verb, source, tmp_path / "out")
    assert code == 130 and "interrupted" in err
    assert _nothing_written(tmp_path / "out")
    # With --force over an existing output, a failure leaves the old output as it was.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("old")
    monkeypatch.setattr(convert_mod, target, _fail_after(5, KeyboardInterrupt, original))
    code, _ = _run(capsys, verb, source, tmp_path / "out", "--force")
    assert code == 130 and (tmp_path / "out" / "keep").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_verification_exits_1(src, tmp_path, capsys, monkeypatch):
    import mcore_rl.conversion.verify as verify_mod

    monkeypatch.setattr(verify_mod, "verify_conversion",
                        lambda *a, **k: VerifyReport(0.5, 3.0, 3, 16, "TP1·PP1"))
    code = main(["hf-to-mcore", str(src), str(tmp_path / "out"), "--no-progress", "--verify"])
    captured = capsys.readouterr()
    assert code == 1 and "verification FAILED: max |logit diff| 5.000e-01" in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["verify"] == {"max_abs_diff": 0.5, "grid": "TP1·PP1", "ok": False}
    # the conversion completed, but it is not verified: nothing at DST, no hidden leftover
    assert f"; nothing written at {tmp_path / 'out'}" in captured.err
    assert list(tmp_path.iterdir()) == []
