"""HF → dist checkpoint → Megatron at grids with expert parallelism → megatron's own saver →
HF is bit-exact, for Qwen3, Qwen3-MoE and Mixtral; at every grid the loaded model computes HF
transformers' logits. One 2-rank launch runs every case.

Each case converts the HF folder (hf-to-mcore), loads it into Megatron on the grid with
`dist_checkpointing.load`, saves it again with `dist_checkpointing.save` (experts stored per
EP rank as megatron stores them: 'mlp.experts.experts.*' with an expert axis; the local spec's
MoE norm under 'mlp.linear_fc1.layer_norm_weight') and converts that back (mcore-to-hf).
"""

from __future__ import annotations

import pytest

from mcore_rl.conversion.convert import hf_to_mcore, mcore_to_hf
from mcore_rl.conversion.verify import hf_logits, prompt_tokens
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig

from .grid_ranks import load_and_save_cases
from .helpers import assert_bit_exact

CASES = {  # label: (family, grid) — 2 ranks each
    "qwen3_tp2": ("qwen3", ParallelConfig(tp=2)),                   # q/k norms, head_dim 48
    "qwen3_moe_ep2": ("qwen3_moe", ParallelConfig(dp=2, ep=2)),     # 2 experts per rank
    "qwen3_moe_tp2ep2": ("qwen3_moe", ParallelConfig(tp=2, ep=2, etp=1)),  # dense TP, experts EP
    "qwen3_moe_etp2": ("qwen3_moe", ParallelConfig(tp=2)),          # each expert split 2 ways
    "mixtral_ep2": ("mixtral", ParallelConfig(dp=2, ep=2)),
    "mixtral_pp2": ("mixtral", ParallelConfig(pp=2)),               # experts over 2 stages
}


@pytest.fixture(scope="module")
def moe_run(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_grids")
    specs, cases = {}, []
    for family in sorted({f for f, _ in CASES.values()}):
        specs[family] = ModelSpec.from_hf_dir(hf_dirs[family])
        hf_to_mcore(hf_dirs[family], root / family, progress=False)
    tokens = prompt_tokens(specs["qwen3"], prompts=2, seq_len=12)
    for label, (family, grid) in CASES.items():
        cases.append((label, specs[family], str(root / family), grid, str(root / label)))
    per_rank = run_on_ranks(load_and_save_cases, 2, cases, tokens, timeout_s=600)
    logits = {k: v for r in per_rank for k, v in r.items()}
    refs = {f: hf_logits(hf_dirs[f], tokens) for f in specs}
    return {"root": root, "logits": logits, "refs": refs}


@pytest.mark.parametrize("label", CASES)
def test_grid_round_trip_is_bit_exact_and_computes_hf_logits(moe_run, hf_dirs, label, tmp_path):
    family, _ = CASES[label]
    diff = float((moe_run["logits"][label] - moe_run["refs"][family]).abs().max())
    print(f"{label}: max |logit diff| vs HF {diff:.2e}")
    assert diff <= 1e-4, f"{label}: max |logit diff| {diff:.2e}"
    mcore_to_hf(moe_run["root"] / label, tmp_path / "hf", hf_config=hf_dirs[family],
                progress=False, max_shard_bytes=200_000)
    assert_bit_exact(hf_dirs[family], tmp_path / "hf")
