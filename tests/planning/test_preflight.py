"""Preflight: every bad config yields its named problem (with a fix), all problems of a config
come out at once, and the shipped configs pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.cli import main
from mcore_rl.planning.preflight import preflight_file

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "gpu"
L70, L8 = CONFIGS / "llama3-70b.yaml", CONFIGS / "llama3-8b.yaml"

# A CPU run of the kind the project runs on its 2-core machines: micro model, 2 training ranks,
# one vLLM engine at tp 2 (mp executor), gloo sync, disaggregated on 4 processes.
CPU = ["model=micro", "device=cpu", "placement=disaggregated", "nodes=1", "gpus_per_node=4",
       "device_gib=8", "reserve_gib=1", "sync_backend=gloo", "train.parallel.tp=2",
       "train.parallel.pp=1", "train.parallel.dp=1", "train.parallel.sequence_parallel=false",
       "train.seq_len=256", "train.global_batch_size=8", "train.dtype=fp32",
       "train.recompute=none", "rollout.tp=2", "rollout.engines=1", "rollout.dtype=float32",
       "rollout.gpu_memory_utilization=null", "rollout.max_num_seqs=16", "rollout.executor=mp"]

BAD = [
    # id, base, overrides, expected problem
    ("tp-vs-heads", L70, ["train.parallel.tp=3", "train.parallel.pp=8", "nodes=7"],
     "train-tp"),                                  # 64 heads / 8 kv heads not split by 3
    ("pp-vs-layers", L70, ["train.parallel.pp=3", "nodes=7"], "train-pp"),   # 80 % 3
    ("uneven-pp", L70, ["train.parallel.first_stage_layers=15",
                        "train.parallel.last_stage_layers=10"], "train-pp"),  # 55 over 2
    ("vpp-vs-layers", L70, ["train.parallel.vpp=3"], "train-pp"),             # 80 % 12
    ("batch-vs-dp", L8, ["train.global_batch_size=255"], "train-batch"),      # 255 % (1·2)
    ("vpp-batch", L70, ["train.parallel.vpp=2", "train.global_batch_size=6"],
     "train-batch-vpp"),                           # 6 micro batches, pp 4
    ("seq-len", L70, ["train.seq_len=16384"], "seq-len"),                     # > 8192
    ("sp-seq-len", L8, ["train.seq_len=4094"], "seq-len-sp"),                 # 4094 % tp 4
    ("world-disagg", L70, ["nodes=6"], "world-size"),                         # 32 + 32 != 48
    ("world-coloc", L8, ["train.parallel.dp=1"], "world-size"),               # 4 != 8
    ("world-coloc-rollout", L8, ["rollout.engines=2"], "world-size-rollout"),  # 4 != 8
    ("rollout-tp-heads", L70, ["rollout.tp=3"], "rollout-tp"),               # 64 heads % 3
    ("rollout-tp-kv", CONFIGS / "llama2-13b.yaml", ["rollout.tp=3", "rollout.engines=2",
                                                    "nodes=3"], "rollout-tp"),
    ("rollout-tp-node", L70, ["rollout.tp=16", "rollout.engines=2"], "rollout-tp-node"),
    ("rollout-straddles", L70, ["gpus_per_node=12", "nodes=4", "rollout.tp=8",
                                "rollout.engines=2", "train.parallel.pp=4"],
     "rollout-tp-node"),                           # 12-device nodes, 8-device engines
    ("uni-tp8", L70, ["rollout.executor=uni"], "rollout-executor"),
    ("cpu-ray", None, ["rollout.executor=ray"], "rollout-executor"),          # refused on CPU
    ("cpu-nccl", None, ["sync_backend=nccl"], "sync-backend"),
    ("gpu-gloo", L70, ["sync_backend=gloo"], "sync-backend"),
    ("memory", L70, ["device_gib=48"], "memory"),
    ("colocated-util", L8, ["rollout.gpu_memory_utilization=0.9"], "colocated-gpu-util"),
    ("kv-too-small", L70, ["rollout.gpu_memory_utilization=0.21"], "rollout-kv"),
    ("zero-engines", L70, ["rollout.engines=0"], "config"),
    ("unknown-field", L70, ["train.learning_rate=1e-6"], "config"),
    ("bad-value", L70, ["placement=hybrid"], "config"),
]


def _run(base, overrides):
    if base is None:
        return preflight_file(CONFIGS / "llama3-8b.yaml", CPU + overrides)
    return preflight_file(base, overrides)


@pytest.mark.parametrize("row_id,base,overrides,expected", BAD, ids=[r[0] for r in BAD])
def test_bad_config_names_its_problem(row_id, base, overrides, expected):
    _, problems = _run(base, overrides)
    errors = [p for p in problems if p.severity == "error"]
    assert expected in {p.check for p in errors}, problems
    for p in problems:
        assert p.message and p.fix


@pytest.mark.parametrize("base", [L70, L8, CONFIGS / "llama2-13b.yaml", None],
                         ids=["llama3-70b", "llama3-8b", "llama2-13b", "cpu-micro"])
def test_good_configs_pass(base):
    _, problems = _run(base, [])
    assert not [p for p in problems if p.severity == "error"], problems


def test_every_problem_at_once():
    _, problems = preflight_file(L8, ["train.parallel.tp=3", "nodes=2", "sync_backend=gloo",
                                      "rollout.executor=uni", "train.seq_len=9000",
                                      "train.global_batch_size=255"])
    checks = {p.check for p in problems if p.severity == "error"}
    assert {"train-tp", "world-size", "world-size-rollout", "rollout-executor",
            "sync-backend", "seq-len", "train-batch"} <= checks


def test_hf_dir_and_cpu_head_dim(tmp_path):
    """An HF model directory works as `model`; head_dim 16 is refused for CPU engines."""
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 300, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, problems = _run(None, [f"model={tmp_path}"])
    assert "cpu-head-dim" in {p.check for p in problems}


def test_cli_preflight(capsys):
    assert main(["preflight", str(L70)]) == 0
    assert main(["preflight", str(L70), "rollout.executor=uni", "nodes=6"]) == 1
    out = capsys.readouterr().out
    assert "[rollout-executor]" in out and "[world-size]" in out and "fix:" in out
