"""`mcore-rl bench logprob | rollout | step`: each runs small end to end, reports the documented
keys with positive ratios and writes JSON + markdown + PNG; the FLOPs/MFU arithmetic matches a
hand-computed example. No assertion depends on how fast anything ran."""

import json
import os
import subprocess
import sys

import pytest

from mcore_rl.bench.report import spread
from mcore_rl.bench.step import FlopsModel, mfu, phase_flops, step_metrics
from mcore_rl.cli import main
from mcore_rl.models.spec import ModelSpec

pytestmark = pytest.mark.slow  # end-to-end: started first on the parallel workers

SPREAD_KEYS = {"median", "min", "max", "runs"}


def run_cli_subprocess(*argv, timeout=400):
    """The CLI in a fresh process: vLLM in-process and Ray change process-wide state."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


def assert_files(out, name):
    for ext in ("json", "md", "png"):
        path = out / f"{name}.{ext}"
        assert path.is_file() and path.stat().st_size > 0, path
    assert json.loads((out / f"{name}.json").read_text())["repeats"] == 2
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| " in (out / f"{name}.md").read_text()


# --- FLOPs / MFU, by hand ---------------------------------------------------------------------

# 2 layers, hidden 64, 2 heads of 32 (d = 64), 1 kv head (kv_dim 32), ffn 128, vocab 100
SPEC = ModelSpec(family="llama", architecture="LlamaForCausalLM", hidden=64, ffn=128, heads=2,
                 kv_heads=1, head_dim=32, layers=2, vocab=100)
# per layer: attention 64*(64 + 2*32) + 64*64 = 12288, MLP 3*64*128 = 24576 -> 36864;
# N = 2 * 36864 + 100*64 (output layer) = 80128; the critic: 73728 + 64 (value head) = 73792
N, N_CRITIC = 80128, 73792
# one sequence of 10 tokens: forward 2*N*10 + 4*L*d*10^2 = 1_602_560 + 51_200 = 1_653_760
FWD_10 = 1_653_760


def test_flops_model_matches_hand_computation():
    policy, critic = FlopsModel.policy(SPEC), FlopsModel.critic(SPEC)
    assert policy.matmul_params == N and critic.matmul_params == N_CRITIC
    assert policy.forward([10]) == FWD_10
    assert policy.train([10]) == 3 * FWD_10 == 4_961_280  # 6N*s + 12*L*d*s^2
    assert policy.forward([10, 10, 5]) == 2 * FWD_10 + (2 * N * 5 + 4 * 2 * 64 * 25)
    # 4_961_280 FLOPs in 0.5 s on 2 devices of 1e7 FLOP/s peak
    assert mfu(4_961_280, 0.5, 2, 1e7) == pytest.approx(0.496128)
    with pytest.raises(ValueError):
        mfu(1.0, 0.0, 1, 1.0)


def test_phase_flops_and_step_metrics_by_hand():
    flops = phase_flops(SPEC, phases=["gen", "reward", "old_logprob", "ref", "values",
                                      "update_actor", "update_critic", "sync"],
                        rows=3, seq_len=10, gen_seq_lens=[10, 10])
    assert set(flops) == {"gen", "old_logprob", "ref", "values", "update_actor",
                          "update_critic"}  # reward, adv, sync: no model FLOPs
    assert flops["gen"] == 2 * FWD_10
    assert flops["old_logprob"] == flops["ref"] == 3 * FWD_10
    assert flops["update_actor"] == 9 * FWD_10
    critic_fwd_10 = 2 * N_CRITIC * 10 + 4 * 2 * 64 * 100
    assert flops["values"] == 3 * critic_fwd_10 and flops["update_critic"] == 9 * critic_fwd_10

    timings = {"gen": 1.0, "old_logprob": 0.5, "update_actor": 2.0, "sync": 0.5, "step": 5.0}
    used = {k: flops[k] for k in ("gen", "old_logprob", "update_actor")}
    m = step_metrics(timings, used, actor_devices=2, rollout_devices=1, tokens=20,
                     peak_flops_per_device=1e7)
    assert m["sync_share"] == pytest.approx(0.1)
    assert m["tokens_per_s_per_device"] == pytest.approx(20 / 5.0 / 3)
    assert m["step_flops"] == 14 * FWD_10
    assert m["mfu"] == pytest.approx(14 * FWD_10 / (5.0 * 3 * 1e7))
    assert m["mfu/gen"] == pytest.approx(2 * FWD_10 / (1.0 * 1 * 1e7))  # engine devices
    assert m["mfu/update_actor"] == pytest.approx(9 * FWD_10 / (2.0 * 2 * 1e7))  # actor's


def test_spread():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                       "runs": [3.0, 1.0, 2.0]}


# --- the commands end to end ------------------------------------------------------------------

def test_logprob_bench(capsys, tmp_path):
    code = main(["bench", "logprob", "tokens=256", "vocab=4096", "backward=true",
                 "--repeats", "2", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for path in ("ours", "baseline"):
        assert set(report[path]["wall_s"]) == SPREAD_KEYS
        assert len(report[path]["wall_s"]["runs"]) == 2
        assert set(report[path]["peak_extra_bytes"]) == {"0", "1"}
    assert report["speedup_vs_baseline"] > 0 and report["memory_ratio_vs_baseline"] > 0
    # the same numbers from both paths
    assert report["max_abs_diff_logp"] < 1e-4 and report["max_abs_diff_entropy"] < 1e-4
    assert report["max_abs_diff_grad"] < 1e-5
    # the baseline materializes the full vocabulary on every rank (allocations are
    # deterministic, so these are not timing assertions)
    assert report["baseline"]["max_peak_extra_bytes"] >= report["full_logits_bytes"]
    assert report["ours"]["max_peak_extra_bytes"] < report["baseline"]["max_peak_extra_bytes"]
    assert_files(tmp_path, "logprob")


def test_rollout_bench(tmp_path):
    report, stdout = run_cli_subprocess(
        "bench", "rollout", "prompts=4", "prompt_len=8", "max_new_tokens=8",
        "--repeats", "2", "--out", str(tmp_path))
    for engine in ("vllm", "hf"):
        assert report[engine]["tokens"] == 4 * 8
        assert set(report[engine]["tokens_per_s"]) == SPREAD_KEYS
        assert report[engine]["tokens_per_s"]["min"] > 0
    assert report["speedup_vs_hf"] > 0
    assert 0 <= report["greedy_agreement"] <= 1
    assert "vLLM / HF" in stdout
    assert_files(tmp_path, "rollout")


def test_step_bench(tmp_path):
    report, stdout = run_cli_subprocess(
        "bench", "step", "--repeats", "2", "untimed_steps=1", "peak_tflops=0.5",
        "--out", str(tmp_path), "compare=[rollout.mode=async]", "baseline=trl",
        "actor.dp=1", "algorithm.rollout_correction.mode=none",  # the demo's bypass has no pass
        "prompts_per_step=2", "samples_per_prompt=4", "updates_per_batch=1",
        "train.micro_batch_size=4", "warmup.max_steps=0")
    for phase in ("gen", "reward", "old_logprob", "adv", "update_actor", "sync", "step"):
        assert set(report["timing_s"][phase]) == SPREAD_KEYS
        assert len(report["timing_s"][phase]["runs"]) == 2
    assert set(report["mfu_by_phase"]) == {"gen", "old_logprob", "update_actor"}
    assert 0 < report["sync_share"]["median"] < 1
    assert report["tokens_per_s_per_device"]["median"] > 0 and report["mfu"]["median"] > 0
    # one actor rank and the demo's two TP1 engines: the second, late, joined before the
    # measured steps (each generated on both)
    assert report["devices"] == 3 and report["peak_tflops_per_device"] == 0.5
    assert report["peak_source"] == "given (peak_tflops)"
    assert [s["rollout_engines"] for s in report["per_step"]] == [2.0, 2.0]
    # the report's MFU is the documented formula applied to the reported numbers
    first = report["per_step"][0]
    assert first["mfu"] == pytest.approx(
        sum(first["flops"].values()) / (first["timings"]["step"] * 3 * 0.5e12))
    assert first["flops"]["update_actor"] == pytest.approx(3 * first["flops"]["old_logprob"])
    assert "sync share" in stdout
    # the async variant ran in the same invocation: its steps waited on generation that
    # ran beside training, and the speed-up is the ratio of the two median steps
    variant = report["compare"]
    assert variant["overrides"] == ["rollout.mode=async"] and "gen_wait" in variant["timing_s"]
    assert "gen_wait" not in report["timing_s"]
    assert variant["step_speedup"] == pytest.approx(
        report["timing_s"]["step"]["median"] / variant["timing_s"]["step"]["median"])
    assert "variant rollout.mode=async" in stdout
    assert_files(tmp_path, "step")
    # TRL ran the same number of steps on the same prompts from the same starting weights
    # (warmup.max_steps=0: the starting model), and the ratio is of the two median steps
    trl = report["baseline"]
    assert trl["name"] == "trl" and trl["version"] == "1.16.0"
    assert report["steps_run"] == trl["steps_run"] == 3 and trl["same_prompts"] is True
    for phase in ("gen", "reward", "old_logprob", "prep", "update", "step"):
        assert set(trl["timing_s"][phase]) == SPREAD_KEYS
        assert len(trl["timing_s"][phase]["runs"]) == 2
    assert trl["timing_s"]["gen"]["min"] > 0 and len(trl["reward_mean"]) == 3
    assert report["ratio_vs_trl"] == pytest.approx(
        report["timing_s"]["step"]["median"] / trl["timing_s"]["step"]["median"])
    assert trl["startup_s"] > 0 and trl["process_s"] >= trl["startup_s"]
    # our start-up's CPU work, by role, and the shortest wall time it allows on these cores
    cpu = report["startup_cpu_s"]
    assert cpu["actor ranks"] > 1.0 and cpu["engines"] > 1.0, cpu
    assert report["startup_cpu_floor_s"] == pytest.approx(
        cpu["total"] / len(os.sched_getaffinity(0)), abs=0.01)
    assert "start-up CPU" in stdout
    assert "ours / TRL median step" in stdout


@pytest.mark.parametrize("argv, message", [
    (["logprob", "vocab=4097"], "vocab=4097"),
    (["logprob", "tp=1"], "tp=1"),
    (["logprob", "dtype=int8"], "dtype='int8'"),
    (["rollout", "max_new_tokens=0"], "max_new_tokens=0"),
    (["rollout", "max_new_token=8"], "max_new_token=8: unknown field"),
    (["step", "no_such_field=1"], "no_such_field"),
    (["step", "peak_tflops=0"], "peak_tflops"),
    # a GPU's peak is not measured here: a GPU run names it
    (["step", "cluster.device=gpu"], "peak_tflops=None: a GPU run's dense peak per device"),
    # the old flags name the override that replaced them
    (["step", "--peak-tflops", "0.5"], "--peak-tflops='0.5': bench step takes it as the "
                                       "override peak_tflops=VALUE"),
    (["step", "--compare", "rollout.mode=async"], "override compare=VALUE"),
    # a setting the TRL baseline cannot match is refused before anything starts
    (["step", "baseline=trl", "algorithm.kl_coeff=0.1"], "algorithm.kl_coeff"),
])
def test_bad_input_fails_before_anything_starts(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
