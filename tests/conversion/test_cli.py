"""The CLI end to end: `mcore-rl convert` is registered, `python -m tools.checkpoint_convert`
runs, and --verify loads the result into Megatron (TP2, spawned ranks) and HF transformers and
reports the logit difference in its JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys

from mcore_rl.cli import main as mcore_rl_main
from tools.checkpoint_convert.cli import main

from .helpers import assert_bit_exact


def test_mcore_rl_convert_is_registered(hf_dirs, tmp_path, capsys):
    src = hf_dirs["llama_gqa"]
    assert mcore_rl_main(["convert", "hf-to-mcore", str(src), str(tmp_path / "mc"),
                          "--no-progress"]) == 0
    assert mcore_rl_main(["convert", "mcore-to-hf", str(tmp_path / "mc"), str(tmp_path / "hf"),
                          "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["direction"] == "mcore-to-hf" and summary["tensors"] == 39
    assert lines[-2].startswith("mcore-to-hf: 39 tensors, ")
    assert_bit_exact(src, tmp_path / "hf")


def test_cli_with_verify(hf_dirs, tmp_path, capsys):
    """`--dtype bf16 --verify --verify-tp 2`: both sides see the bf16-rounded weights and
    compute in fp32, so only fp32 rounding differences remain."""
    src = hf_dirs["qwen2_tied_bias"]
    code = main(["hf-to-mcore", str(src), str(tmp_path / "mc"), "--dtype", "bf16", "--verify",
                 "--verify-tp", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["dtype"] == "bfloat16" and summary["verify"]["ok"]
    assert summary["verify"]["max_abs_diff"] <= 1e-5 and summary["verify"]["grid"] == "TP2·PP1"
    assert "verify: max |logit diff| = " in captured.out
    assert "hf-to-mcore" in captured.err and "30/30 tensors" in captured.err   # progress bar


def test_module_entry_point_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tools.checkpoint_convert", "mcore-to-hf",
                           str(tmp_path / "missing"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "missing does not exist" in proc.stderr
