"""Preflight: every bad config yields its named problem (with a fix naming the run config's
own fields), all problems of a config come out at once, and the shipped configs pass — on this
CPU machine, without their weights (model.preset sizes them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_rl.cli import main
from mcore_rl.config import load_config
from mcore_rl.planning.memory import with_overrides
from mcore_rl.planning.preflight import preflight
from mcore_rl.trainer.preflight import preflight_config, rl_field_names, run_shape_of
from mcore_rl.trainer.rl_config import RLConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "gpu"
L70, L8, L13 = (CONFIGS / f"{n}.yaml" for n in ("llama3-70b", "llama3-8b", "llama2-13b"))
GRPO = ROOT / "configs" / "grpo_addition.yaml"

# A CPU run of the kind the project runs on its 2-core machines: the demo model, 2 training
# ranks, one vLLM engine at tp 2 (mp executor), gloo sync, disaggregated on 4 processes.
CPU = ["cluster.device=cpu", "cluster.placement=disaggregated", "cluster.nodes=1",
       "cluster.gpus_per_node=4", "cluster.device_gib=8", "cluster.reserve_gib=1",
       "cluster.sync_backend=gloo", "actor.tp=2", "rollout.tp=2", "rollout.engines=1"]

# a reward model the size of the policy (not on this machine: sized from its preset)
RM = ["reward_model.enabled=true", "reward_model.hf_dir=/models/rm-8b",
      "reward_model.preset=llama3-8b", "reward_model.dtype=bf16", "reward_model.parallel.tp=4"]

BAD = [
    # id, base, overrides, expected problem
    ("tp-vs-heads", L70, ["actor.tp=3", "actor.pp=8", "cluster.nodes=7"],
     "train-tp"),                                  # 64 heads / 8 kv heads not split by 3
    ("pp-vs-layers", L70, ["actor.pp=3", "cluster.nodes=7"], "train-pp"),   # 80 % 3
    ("uneven-pp", L70, ["actor.first_stage_layers=15", "actor.last_stage_layers=10"],
     "train-pp"),                                  # 55 over 2 middle stages
    ("vpp-vs-layers", L70, ["actor.vpp=3"], "train-pp"),                   # 80 % 12
    ("vpp-batch", L70, ["actor.vpp=2", "prompts_per_step=3", "samples_per_prompt=2"],
     "train-batch-vpp"),                           # 6 micro batches, pp 4
    ("seq-len", L70, ["train.seq_len=16384"], "seq-len"),                  # > 8192
    ("sp-seq-len", L8, ["train.seq_len=4094"], "seq-len-sp"),              # 4094 % tp 4
    ("world-disagg", L70, ["cluster.nodes=6"], "world-size"),              # 32 + 32 != 48
    ("world-coloc", L8, ["actor.dp=1"], "world-size"),                     # 4 != 8
    ("world-coloc-rollout", L8, ["rollout.engines=2"], "world-size-rollout"),  # 4 != 8
    ("rollout-tp-heads", L70, ["rollout.tp=3"], "rollout-tp"),             # 64 heads % 3
    ("rollout-tp-kv", L13, ["rollout.tp=3", "rollout.engines=2"], "rollout-tp"),  # 40 % 3
    ("rollout-tp-node", L70, ["rollout.tp=16", "rollout.engines=2"], "rollout-tp-node"),
    ("rollout-straddles", L70, ["cluster.gpus_per_node=12", "cluster.nodes=4", "rollout.tp=8",
                                "rollout.engines=2"],
     "rollout-tp-node"),                           # 12-device nodes, 8-device engines
    ("cpu-nccl", GRPO, CPU + ["cluster.sync_backend=nccl"], "sync-backend"),
    ("gpu-gloo", L70, ["cluster.sync_backend=gloo"], "sync-backend"),
    ("memory", L70, ["cluster.device_gib=48"], "memory"),
    ("colocated-util", L8, ["rollout.gpu_memory_utilization=0.9"], "colocated-gpu-util"),
    ("kv-too-small", L70, ["rollout.gpu_memory_utilization=0.21"], "rollout-kv"),
    ("no-weights-no-preset", L70, ["model.preset=null"], "model"),  # nothing to size from
    ("zero-engines", L70, ["rollout.engines=0"], "config"),
    ("unknown-field", L70, ["train.learning_rate=1e-6"], "config"),
    ("bad-value", L70, ["cluster.placement=hybrid"], "config"),
    ("batch-vs-micro", L8, ["train.micro_batch_size=3"], "config"),  # 128 per DP rank % 3
    ("reward-model-world", L8, RM + ["reward_model.parallel.tp=8", "reward_model.parallel.dp=2"],
     "reward-model-world"),                        # 16 reward ranks on 8 actor devices
    ("reward-model-grid", L8, RM + ["reward_model.parallel.tp=3"], "reward-model-grid"),
    ("reward-model-unsized", L8, RM + ["reward_model.preset=null"], "model"),
]

# Checks a run config cannot reach (its executor follows rollout.tp, its global batch is
# whole), kept for the planner's own input: RunShape overrides on a shipped config's shape.
PLANNER_ONLY = [
    ("uni-tp8", L70, ["rollout.executor=uni"], "rollout-executor"),
    ("cpu-ray", GRPO, ["rollout.executor=ray"], "rollout-executor"),       # refused on CPU
    ("batch-vs-dp", L8, ["train.global_batch_size=255"], "train-batch"),   # 255 % (1·2)
]


@pytest.mark.parametrize("row_id,base,overrides,expected", BAD, ids=[r[0] for r in BAD])
def test_bad_config_names_its_problem(row_id, base, overrides, expected):
    _, problems = preflight_config(base, overrides)
    errors = [p for p in problems if p.severity == "error"]
    assert expected in {p.check for p in errors}, problems
    for p in problems:
        assert p.message and p.fix
        # texts speak the run config's language, never the planner's internal field names
        assert "train.parallel" not in p.message + p.fix, p
        assert "train.global_batch_size" not in p.fix, p


@pytest.mark.parametrize("row_id,base,overrides,expected", PLANNER_ONLY,
                         ids=[r[0] for r in PLANNER_ONLY])
def test_planner_only_checks(row_id, base, overrides, expected):
    cfg = load_config(RLConfig, base, CPU if base == GRPO else [])
    problems = preflight(with_overrides(run_shape_of(cfg), overrides))
    assert expected in {p.check for p in problems if p.severity == "error"}, problems


@pytest.mark.parametrize("base,overrides", [(L70, []), (L8, []), (L13, []), (GRPO, CPU)],
                         ids=["llama3-70b", "llama3-8b", "llama2-13b", "cpu-demo"])
def test_good_configs_pass(base, overrides):
    cfg, problems = preflight_config(base, overrides)
    assert cfg is not None
    assert not [p for p in problems if p.severity == "error"], problems


def test_gpu_configs_are_sized_from_their_cluster_and_preset():
    """On this CPU machine the GPU configs are sized for their GPUs, from the preset."""
    shape = run_shape_of(load_config(RLConfig, L70))
    assert not Path("/models/Meta-Llama-3-70B-Instruct/config.json").exists()
    assert (shape.model, shape.device, shape.nodes, shape.device_gib) == (
        "llama3-70b", "gpu", 8, 80.0)
    assert shape.train.parallel.pp == 4 and shape.train.recompute == "selective"
    assert shape.train.reference and not shape.train.critic
    assert run_shape_of(load_config(RLConfig, L13)).train.critic  # PPO: gae
    coloc = run_shape_of(load_config(RLConfig, L8))
    assert (coloc.placement, coloc.rollout.sleep, coloc.rollout.executor) == (
        "colocated", "all", "mp")


def test_reward_model_memory_is_planned_on_the_training_devices():
    """A reward model's weights sit on the actor's devices for the whole run; while it scores
    (before the engines sleep) a colocated engine is awake beside it."""
    from mcore_rl.planning.memory import mcore_stage_params, plan_memory

    base = plan_memory(run_shape_of(load_config(RLConfig, L8)))
    with_rm = plan_memory(run_shape_of(load_config(RLConfig, L8, RM)))
    rm = next(r for r in with_rm.roles if r.role == "reward model")
    spec = load_config(RLConfig, L8, RM).reward_model.planning_model()
    from mcore_rl.models.presets import PRESETS
    from mcore_rl.parallel import ParallelConfig

    par = ParallelConfig(tp=4)
    stage_params = mcore_stage_params(PRESETS[spec], par, 0, "value")
    assert rm.components[0].bytes == 2 * stage_params  # bf16, one stage, value head
    for before, after in zip(base.devices, with_rm.devices):
        gained = after.peak.total - before.peak.total
        assert gained >= rm.resident  # resident in every phase of the shared device
    scoring = next(p for p in with_rm.devices[0].phases if p.name == "reward scoring")
    assert any(name == "rollout engine" for name, _ in scoring.parts)  # colocated: awake


def test_fix_names_the_run_config_field():
    _, problems = preflight_config(L8, ["actor.tp=3"])
    tp = [p for p in problems if p.check == "train-tp"]
    assert tp and tp[0].fix.startswith("actor.tp one of 1, 2, 4, 8"), tp
    assert "actor.tp=3" in tp[0].message
    world = [p for p in problems if p.check == "world-size"]
    assert world and "cluster.nodes=" not in world[0].message  # prose keeps "nodes ×"


def test_every_problem_at_once():
    _, problems = preflight_config(L8, ["actor.tp=3", "cluster.nodes=2",
                                        "cluster.sync_backend=gloo", "train.seq_len=9000"])
    checks = {p.check for p in problems if p.severity == "error"}
    assert {"train-tp", "world-size", "world-size-rollout", "sync-backend", "seq-len"} <= checks


def test_field_renames():
    assert rl_field_names("train.parallel.dp=2 or nodes=3") == "actor.dp=2 or cluster.nodes=3"
    assert rl_field_names("spans nodes (gpus_per_node=8)") == \
        "spans nodes (cluster.gpus_per_node=8)"
    assert rl_field_names("rollout.sleep=all; rollout.tp=2") == \
        "rollout.enable_sleep=true; rollout.tp=2"
    assert rl_field_names("parallel.tp=4: does not divide") == "actor.tp=4: does not divide"


def _hf_dir(path: Path, head_dim: int) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4 * head_dim,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 300, "max_position_embeddings": 512}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_hf_dir_and_cpu_head_dim(tmp_path):
    """An HF model directory on this machine is what preflight sizes (over the preset);
    head_dim 16 is refused for CPU engines; a preset that disagrees is a warning."""
    hf = _hf_dir(tmp_path / "m", head_dim=16)
    _, problems = preflight_config(GRPO, CPU + [f"model.hf_dir={hf}"])
    assert "cpu-head-dim" in {p.check for p in problems}
    hf32 = _hf_dir(tmp_path / "m32", head_dim=32)
    _, problems = preflight_config(GRPO, CPU + [f"model.hf_dir={hf32}", "model.preset=micro"])
    assert not [p for p in problems if p.severity == "error"], problems
    assert [p.check for p in problems if p.severity == "warning"] == ["model-preset"]


def test_cli_preflight(capsys):
    assert main(["preflight", str(L70)]) == 0
    assert main(["preflight", str(L70), "cluster.nodes=6", "actor.tp=3"]) == 1
    out = capsys.readouterr().out
    assert "[world-size]" in out and "[train-tp]" in out and "fix: actor.tp one of" in out
    assert "train.parallel" not in out
