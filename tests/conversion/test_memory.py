"""Conversion streams: peak RSS of a converting process grows by at most about twice the
largest tensor, on a model several times that size, in both directions.

Each conversion runs the CLI in a fresh child process. The child imports everything first,
reads its RSS (psutil), resets the kernel's peak-RSS mark (/proc/self/clear_refs, "5"), converts,
and reports the peak (VmHWM) — so the measured growth is the conversion's alone, while the
~0.5 GB of torch/megatron/transformers imports is the fixed part of the budget.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

from mcore_rl.conversion.layout import checkpoint_layout

from .helpers import MICRO, assert_bit_exact, write_random_hf_dir

# ~220 MiB fp32; the largest tensor is the 8000-row embedding (8064 rows padded: 15.8 MiB).
SPEC = MICRO.with_(hidden=512, ffn=1536, heads=8, kv_heads=4, head_dim=64, layers=16,
                   vocab=8000)
# allocator slack, checkpoint metadata, Python objects. Measured growth (session 8): 38-40 MiB
# in the working tree's venv, 44-48 MiB in a fresh clone's (the pre-session-8 code as well:
# 43.9-44.9), so 16 MiB left no room; with 20 the bound is still under a quarter of the model,
# which a gather of the whole model (223 MiB) could not pass
FIXED_BYTES = 20 * 2 ** 20

_CHILD = r"""
import json, sys, time
import psutil
import torch, megatron.core.dist_checkpointing, transformers, tqdm   # the fixed part
from transformers import LlamaConfig
from tools.checkpoint_convert import cli
import mcore_rl.conversion.convert

def peak_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

base = psutil.Process().memory_info().rss
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                       # peak RSS := current RSS
t = time.perf_counter()
code = cli.main(sys.argv[1:])
seconds = time.perf_counter() - t
print("RESULT " + json.dumps({"code": code, "base": base, "peak": peak_kb() * 1024,
                              "seconds": seconds}))
"""


def _convert_in_child(*argv) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, *map(str, argv), "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["code"] == 0
    return result


def test_peak_rss_is_about_twice_the_largest_tensor(tmp_path):
    src = write_random_hf_dir(SPEC, tmp_path / "hf", max_shard_bytes=100 * 2 ** 20)
    element = torch.empty((), dtype=torch.float32).element_size()
    # Every HF tensor lies inside one Megatron (TP1) tensor: the largest of those bounds both.
    largest = max(math.prod(t.local.shape) for t in checkpoint_layout(SPEC).tensors) * element
    model_bytes = SPEC.num_params() * element
    bound = 2 * largest + FIXED_BYTES
    assert model_bytes >= 4 * bound, "the model must be several times the memory bound"
    results = {
        "hf-to-mcore": _convert_in_child("hf-to-mcore", src, tmp_path / "mc"),
        "mcore-to-hf": _convert_in_child("mcore-to-hf", tmp_path / "mc", tmp_path / "back",
                                         "--max-shard-size", "100MiB"),
    }
    assert_bit_exact(src, tmp_path / "back")
    for verb, r in results.items():
        growth = r["peak"] - r["base"]
        print(f"{verb}: model {model_bytes / 2**20:.0f} MiB, largest tensor "
              f"{largest / 2**20:.1f} MiB, peak RSS +{growth / 2**20:.1f} MiB over "
              f"{r['base'] / 2**20:.0f} MiB after imports (bound {bound / 2**20:.1f} MiB), "
              f"{model_bytes / 2**20 / r['seconds']:.0f} MiB/s")
        assert growth <= bound, f"{verb}: peak RSS grew by {growth / 2**20:.1f} MiB"
