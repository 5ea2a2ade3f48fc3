"""A converted checkpoint loads into Megatron at any grid with megatron's own loader
(`dist_checkpointing.load(model.sharded_state_dict(), dir)`) and reproduces HF's logits; a
checkpoint megatron itself saves at TP2·PP2 loads at every other grid too and converts back to
the original HF tensors bit for bit; that HF output runs in vLLM exactly like in transformers.

One 4-rank launch builds the Mistral-style model (8 heads, 4 kv heads, 4 layers) at each grid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mcore_rl.conversion.convert import hf_to_mcore, mcore_to_hf
from mcore_rl.conversion.dcp_io import ChunkReader
from mcore_rl.conversion.verify import hf_logits, prompt_tokens
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.spec import ModelSpec
from mcore_rl.parallel.config import ParallelConfig

from .grid_ranks import load_at_grids
from .helpers import assert_bit_exact

GRIDS = [  # 4 ranks each
    ("tp2pp2", ParallelConfig(tp=2, pp=2)),               # first: also saved by megatron here
    ("tp1pp1", ParallelConfig(dp=4)),                     # one-process layout (4 DP replicas)
    ("tp4pp1", ParallelConfig(tp=4)),                     # one kv head per rank, vocab pad 512
    ("tp1pp4", ParallelConfig(pp=4)),                     # one layer per stage
    ("tp1pp2vpp2", ParallelConfig(pp=2, vpp=2, dp=2)),    # interleaved chunks (model0/model1)
]
SOURCES = ["converted", "megatron_tp2pp2"]


@pytest.fixture(scope="module")
def grid_run(hf_dirs, tmp_path_factory):
    src = hf_dirs["mistral"]
    spec = ModelSpec.from_hf_dir(src)
    root = tmp_path_factory.mktemp("grids")
    hf_to_mcore(src, root / "converted", progress=False)
    tokens = prompt_tokens(spec, prompts=3, seq_len=16)
    per_rank = run_on_ranks(load_at_grids, 4, spec, str(root / "converted"),
                            str(root / "saved"), GRIDS, tokens, timeout_s=600)
    logits = {k: v for r in per_rank for k, v in r.items()}
    # Megatron's own checkpoint has no hf_config/: the config comes from the HF folder.
    mcore_to_hf(root / "saved", root / "from_megatron", hf_config=src, progress=False,
                max_shard_bytes=200_000)
    return {"src": src, "spec": spec, "root": root, "tokens": tokens, "logits": logits,
            "hf": hf_logits(src, tokens)}


# Megatron's own checkpoint is saved at TP2·PP2 after that grid's loads: it is loaded at
# every other grid.
GRID_SOURCES = [(grid, source) for source in SOURCES for grid, _ in GRIDS
                if (grid, source) != ("tp2pp2", "megatron_tp2pp2")]


@pytest.mark.parametrize("grid, source", GRID_SOURCES)
def test_logits_match_hf_at_every_grid(grid_run, grid, source):
    got = grid_run["logits"][(grid, source)]
    diff = float((got - grid_run["hf"]).abs().max())
    print(f"{source} at {grid}: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5, f"{source} at {grid}: max |logit diff| {diff:.2e}"


def test_megatron_saved_checkpoint_has_the_converted_keys_and_shapes(grid_run):
    """The converted checkpoint is what megatron itself writes, up to the vocab padding the
    saver's TP chose (TP1: 128 rows, TP2: 256)."""
    ours = ChunkReader(grid_run["root"] / "converted").metadata.state_dict_metadata
    theirs = ChunkReader(grid_run["root"] / "saved").metadata.state_dict_metadata
    assert set(ours) == set(theirs)
    padded = {"embedding.word_embeddings.weight", "output_layer.weight"}
    for key, md in ours.items():
        if not hasattr(md, "size"):
            continue                                   # extra-state objects
        if key in padded:
            assert (md.size[0], theirs[key].size[0]) == (128, 256) and \
                md.size[1:] == theirs[key].size[1:], key
        else:
            assert md.size == theirs[key].size and \
                md.properties.dtype == theirs[key].properties.dtype, key


def test_megatron_saved_checkpoint_converts_back_bit_exact(grid_run):
    assert_bit_exact(grid_run["src"], grid_run["root"] / "from_megatron")


_VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
job = json.loads(sys.argv[1])
llm = LLM(model=job["dir"], dtype="float32", enforce_eager=True, seed=0,
          distributed_executor_backend="uni", max_model_len=64, max_num_seqs=8)
greedy = SamplingParams(temperature=0.0, max_tokens=job["max_new"], ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in job["prompt_ids"]], greedy, use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_vllm_greedy_matches_transformers_on_megatron_output(grid_run):
    """vLLM CPU, in-process engine in its own subprocess (it reads env vars at import)."""
    from mcore_rl.models.hf_reference import greedy_generate, load_hf_model, top2_margin
    from mcore_rl.tasks import tokenizer as tk
    from mcore_rl.tasks.addition import AdditionTask

    out_dir = grid_run["root"] / "from_megatron"
    tok, model = tk.load_tokenizer(out_dir), load_hf_model(out_dir)
    prompt_ids = [tk.encode_prompt(tok, p) for p in AdditionTask().heldout_prompts(4)]
    max_new = 6
    want = greedy_generate(model, prompt_ids, max_new_tokens=max_new)
    margins = [top2_margin(model, p + o[:i]) for p, o in zip(prompt_ids, want)
               for i in range(max_new)]
    assert min(margins) > 1e-4, "near-tie in HF greedy: pick another seed"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    job = {"dir": str(out_dir), "prompt_ids": prompt_ids, "max_new": max_new}
    proc = subprocess.run([sys.executable, "-c", _VLLM_SCRIPT, json.dumps(job)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    assert json.loads(lines[-1].removeprefix("RESULT ")) == want
