"""The GPU check's parts (mcore_rl/bench/gpu.py) as their CPU twins: the same code on the CPU
at the micro shape — the actor's log-prob pass and policy update beside the plan of the same
rank, the colocated refit through shared memory, bit-exact, beside a copy of the same bytes,
and the summary that folds the parts and pytest's junit files. Without CUDA a GPU part says
nothing ran and exits 0."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.bench.gpu import markdown, summary

ROOT = Path(__file__).resolve().parents[2]
MICRO = ["model.preset=micro", "train.seq_len=64", "max_prompt_tokens=16", "max_new_tokens=48"]


def _part(tmp_path: Path, *args: str) -> dict:
    """`python -m mcore_rl.bench.gpu ...` in its own process (it joins a process group)."""
    done = subprocess.run([sys.executable, "-m", "mcore_rl.bench.gpu", *args,
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / f"{args[0]}.json").read_text())


def test_the_actor_part_trains_the_planned_rank(tmp_path):
    out = _part(tmp_path, "actor", "--device", "cpu", "--updates", "2", *MICRO)
    assert out["ran"] and out["device"] == "cpu" and out["layer_spec"] == "local"
    assert (out["rows_per_update"], out["seq_len"]) == (16, 64)  # gpu_actor.yaml's batch
    assert len(out["updates"]) == 2
    for update in out["updates"]:
        assert math.isfinite(update["loss"]) and update["grad_norm"] > 0
        assert update["update_tokens"] == 16 * 48  # every row's response: after 16 prompt tokens
    assert out["throughput"]["update_tokens_per_s"] > 0
    memory = out["memory"]  # planned here, measured on a GPU only
    assert memory["planned_bytes"] > memory["planned_resident_bytes"] > 0
    assert memory["measured"] is None and "GPU" in memory["why"]


def test_the_refit_part_is_bit_exact_and_compared_with_a_copy(tmp_path):
    out = _part(tmp_path, "refit", "--device", "cpu", "--model", "micro", "--repeats", "2",
                "--bucket-mb", "1")
    assert out["ran"] and out["check"] == "pass" and out["check_failures"] == {}
    assert out["rounds"] > 1  # 1 MB buckets: the staging buffer is reused
    assert out["bytes_per_sync"] == out["digest_alone"]["bytes"]  # every bf16 weight, once
    assert 0 < out["sync_over_copy"] == pytest.approx(out["sync_gbs"] / out["copy_gbs"])
    assert out["digest_s"] > 0 and out["digest_alone"]["seconds"] > 0


def test_without_cuda_a_gpu_part_says_nothing_ran(tmp_path):
    out = _part(tmp_path, "actor")
    assert out == {"ran": False, "why": "no CUDA device: nothing measured"}


def test_the_summary_folds_the_parts_and_the_junit_files(tmp_path):
    measured = json.loads((ROOT / "docs" / "benchmarks" / "gpu-check-h200.json").read_text())
    for part in ("env", "actor"):  # refit wrote nothing
        (tmp_path / f"{part}.json").write_text(json.dumps(measured[part]))
    junit = tmp_path / "gpu.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="boom"/></testcase>'
        '<testcase classname="tests.b" name="test_gpu"><skipped message="needs vLLM"/>'
        '</testcase></testsuite></testsuites>')
    s = summary(tmp_path, {"gpu": junit, "device_twins": tmp_path / "twins.xml"})
    assert s["pytest"]["gpu"] == {"ran": True, "passed": 1, "failed": 1, "skipped": 1,
                                  "failures": ["tests.a::test_bad"],
                                  "skip_reasons": ["needs vLLM"]}
    assert not s["pytest"]["device_twins"]["ran"]
    assert s["refit"] == {"ran": False, "why": "part refit wrote nothing (see the log)"}
    table = markdown(s)
    assert "| pytest gpu | 1 passed, 1 failed, 1 skipped (failed: tests.a::test_bad) |" in table
    assert "twins.xml (pytest did not finish)" in table
    assert "| refit | not run: part refit wrote nothing (see the log) |" in table
    peak = max(measured["actor"]["memory"]["measured_peak_bytes"]) / (1 << 30)
    assert f"{peak:.2f} GiB" in table and "NVIDIA H200" in table
