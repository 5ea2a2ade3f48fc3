"""Evaluation during RL and the generation log (mcore_rl/rl/evaluation.py): when evaluations
fall, their metrics, and the readable samples in generations.jsonl and TensorBoard's text tab.
A run's evaluations end to end: tests/run/test_demo_learns.py::test_addition_demo_learns."""

from __future__ import annotations

import json
import math

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.rl.evaluation import GenerationLog, eval_metrics, markdown_table, pass_at_k
from mcore_rl.runconfig import EvalConfig, GenerationsConfig, RLConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_evaluations_fall_every_k_steps_after_the_last_and_before_the_first():
    cfg = EvalConfig(every=10)
    assert [s for s in range(0, 26) if cfg.due(s, last_step=25)] == [0, 10, 20, 25]
    assert [s for s in range(0, 26) if EvalConfig(every=10, before_train=False).due(s, 25)] \
        == [10, 20, 25]
    assert not any(EvalConfig(every=0).due(s, 25) for s in range(26))
    assert [s for s in range(1, 31) if GenerationsConfig(every=10).due(s)] == [10, 20, 30]
    assert not any(GenerationsConfig(every=10, samples=0).due(s) for s in range(1, 31))


def test_eval_config_is_validated_under_its_path():
    with pytest.raises(ConfigError, match=r"eval\.samples_per_prompt=0"):
        load_config(RLConfig, None, ["eval.samples_per_prompt=0"])
    with pytest.raises(ConfigError, match=r"logging\.generations\.every=-1"):
        load_config(RLConfig, None, ["logging.generations.every=-1"])


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # 1 - C(n-c, k) / C(n, k): 2 of 4 pass, k = 2 -> 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k failures: some k-subset always passes


def test_eval_metrics_of_a_greedy_and_a_sampled_evaluation():
    greedy = eval_metrics([[1.0], [0.0], [1.0], [0.5]], [[4], [2], [4], [6]], threshold=1.0)
    assert greedy == {"eval/reward_mean": pytest.approx(2.5 / 4), "eval/pass@1": 0.5,
                      "eval/response_length": 4.0, "eval/prompts": 4.0}
    sampled = eval_metrics([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[1, 2, 3], [3, 3, 3]],
                           threshold=0.5)
    assert sampled["eval/pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert sampled["eval/pass@3"] == pytest.approx(0.5)
    assert sampled["eval/response_length"] == pytest.approx(15 / 6)


def test_generation_log_writes_jsonl_and_tensorboard_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = GenerationLog(tmp_path)
    log.write(3, "train", [])  # nothing to show: nothing written
    assert not (tmp_path / "generations.jsonl").exists()
    records = [{"prompt": "12+30=", "response": "042</s>", "reward": 1.0, "answer": "042"},
               {"prompt": "a|b\nc", "response": "x", "reward": 0.0, "answer": {"n": 1}}]
    log.write(10, "train", records)
    log.write(10, "eval", records[:1])
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "generations.jsonl").open()]
    assert rows == [{"step": 10, "kind": "train", **records[0]},
                    {"step": 10, "kind": "train", **records[1]},
                    {"step": 10, "kind": "eval", **records[0]}]
    events = EventAccumulator(str(tmp_path / "tb" / "generations"),
                              size_guidance={"tensors": 0})
    events.Reload()
    tags = events.Tags()["tensors"]
    assert {"generations/train/text_summary", "generations/eval/text_summary"} <= set(tags)
    (text,) = events.Tensors("generations/train/text_summary")
    shown = text.tensor_proto.string_val[0].decode()
    assert text.step == 10 and shown == markdown_table(records)
    # a cell's pipe and newline cannot break the table's rows
    assert "a\\|b<br>c" in shown and shown.count("\n") == 3


def test_the_run_summary_keeps_step_rows_and_names_the_evaluations(tmp_path):
    from mcore_rl.run.train import _summary

    rows = [{"step": 0, "eval/reward_mean": 0.5},
            *({"step": s, "reward_mean": s / 10, **({"eval/reward_mean": 0.75} if s == 6 else {})}
              for s in range(1, 7))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(RLConfig, None, [])
    summary = _summary(cfg, tmp_path, accuracy=None, first_step=1, digests=[], wall_s=1.0)
    assert summary["steps"] == 6
    assert math.isclose(summary["reward_first5"], 0.3) and math.isclose(summary["reward_last5"],
                                                                         0.4)
    assert tuple(summary["eval_first"]) == (0, 0.5)
    assert tuple(summary["eval_last"]) == (6, 0.75)


def test_preflight_warns_of_evaluations_that_cannot_run_or_mean_little(tmp_path):
    from mcore_rl.run.preflight import evaluation_problems

    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    jsonl = ["task.kind=jsonl", f"task.path={data}", "model.hf_dir=/nowhere",
             "model.preset=micro"]
    (no_heldout,) = evaluation_problems(load_config(RLConfig, None, jsonl))
    assert no_heldout.severity == "warning" and "task.heldout_path is null" in \
        no_heldout.message
    assert evaluation_problems(load_config(RLConfig, None, [*jsonl, "eval.every=0"])) == []
    assert evaluation_problems(load_config(RLConfig, None,
                                           [*jsonl, f"task.heldout_path={data}"])) == []
    (greedy,) = evaluation_problems(load_config(RLConfig, None, ["eval.samples_per_prompt=4"]))
    assert "eval/pass@4 equals eval/pass@1" in greedy.message
    assert evaluation_problems(load_config(RLConfig, None, [
        "eval.samples_per_prompt=4", "eval.temperature=1.0"])) == []
