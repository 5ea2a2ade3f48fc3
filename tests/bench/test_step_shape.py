"""`mcore-rl bench step shape=qwen2_16k`: a realistic shape (a 4-layer Qwen2 with a 16k BPE
vocabulary, 64-token prompts, 128-token responses) built locally, run end to end against TRL
at the smallest settings; and the pieces it needs (min_new_tokens on both sides, the built
prompts). No assertion depends on how fast anything ran."""

import pytest

from mcore_rl.bench.shapes import get_shape
from mcore_rl.bench.trl_baseline import trl_arguments
from mcore_rl.config import ConfigError, load_config
from mcore_rl.rollout.config import SamplingConfig
from mcore_rl.runconfig import RLConfig
from tests.bench.test_bench_more import SPREAD_KEYS, run_cli_subprocess

SHAPE = get_shape("qwen2_16k")


def test_min_new_tokens_reaches_both_samplers():
    rl = load_config(RLConfig, SHAPE.config, ["model.hf_dir=/m", "task.path=/p.jsonl"])
    assert (rl.min_new_tokens, rl.max_new_tokens) == (128, 128)
    assert trl_arguments(rl, "out", 1)["generation_kwargs"] == {"min_new_tokens": 128}
    demo = load_config(RLConfig, None, [])
    assert demo.min_new_tokens == 0 and trl_arguments(
        load_config(RLConfig, None, ["algorithm.grpo_eps=1e-4", "algorithm.kl_coeff=0",
                                     "algorithm.loss_agg=token-mean"]), "out", 1
    )["generation_kwargs"] is None
    with pytest.raises(ConfigError, match="min_new_tokens"):
        load_config(RLConfig, None, ["max_new_tokens=8", "min_new_tokens=9"])
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingConfig(max_tokens=4, min_tokens=5)


def test_unknown_shape_is_refused(capsys):
    from mcore_rl.cli import main

    assert main(["bench", "step", "shape=qwen2_99k"]) == 2
    assert "qwen2_16k" in capsys.readouterr().err
    # `warmup` is the supervised warm-up only: the bench's unmeasured steps are untimed_steps
    assert main(["bench", "step", "warmup_steps=1"]) == 2
    assert "warmup_steps=1: this key moved: set untimed_steps" in capsys.readouterr().err


@pytest.mark.slow
def test_step_bench_realistic_shape(tmp_path):
    """Built model, tokenizer and prompts; one measured step each side (2 prompts x 2
    samples, one mini-batch); every response on both sides is at least min_new_tokens."""
    report, stdout = run_cli_subprocess(
        "bench", "step", "shape=qwen2_16k", "baseline=trl", "untimed_steps=0",
        "--repeats", "1", "prompts_per_step=2", "samples_per_prompt=2", "updates_per_batch=1",
        "--out", str(tmp_path), timeout=600)
    shape = report["shape"]
    assert shape["name"] == "qwen2_16k" and shape["vocab"] == 16384
    assert report["model_params"] > 10_000_000  # 8.4 M of them embedding and output layer
    assert report["seq_len"] == 64 + 128 - 1 and report["sequences_per_step"] == 4
    for phase in ("gen", "reward", "adv", "update_actor", "sync", "step"):
        assert set(report["timing_s"][phase]) == SPREAD_KEYS
    # no peak given: this machine's own, measured in the run (#47: an honest MFU), and every
    # MFU is against it
    assert report["peak_source"].startswith("measured: a float32 matrix product on one thread")
    peak = report["peak_tflops_per_device"]
    assert peak > 0 and report["config"]["peak_tflops"] == peak
    update = report["per_step"][0]
    assert update["mfu/update_actor"] == pytest.approx(
        update["flops"]["update_actor"] / (update["timings"]["update_actor"]
                                           * report["actor_devices"] * peak * 1e12))
    trl = report["baseline"]
    assert trl["same_prompts"] is True and report["steps_run"] == trl["steps_run"] == 1
    for phase in ("gen", "reward", "old_logprob", "prep", "update", "step"):
        assert set(trl["timing_s"][phase]) == SPREAD_KEYS
    assert report["ratio_vs_trl"] == pytest.approx(
        report["timing_s"]["step"]["median"] / trl["timing_s"]["step"]["median"])
    for lengths in (report["lengths"], trl["lengths"]):
        assert lengths["prompt"]["min"] == lengths["prompt"]["max"] == 64
        assert lengths["response"]["min"] >= 128 and lengths["response"]["count"] == 4
    assert "tokens per sequence: ours prompt 64-64, response 128-128" in stdout
    assert "ours / TRL median step" in stdout and "shape qwen2_16k" in stdout
