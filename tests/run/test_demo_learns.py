"""The demos learn: shortened runs of `mcore-rl demo` (the real CLI: warm-up, Megatron actor,
vLLM engines, streamed sync, GRPO) whose reward must rise — and, for the multi-turn tool demo,
whose tool-error rate must not grow.

These guard the learning dynamics, which the unit tests of the loss, the masks and the engine's
log-probs cannot: the tool demo once stopped learning while every mechanical check passed (its
warm-up stopped on greedy accuracy, leaving sampled rewards at ~0.5 %; a change of summation
order in the warm-up then decided whether the first few rewarded samples pulled RL up or
pushed it into malformed calls). Each run is cut to what shows the rise in under two minutes
here; the full demos stay out of CI."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest


def run_demo(tmp_path, *args: str) -> tuple[list[dict], list[dict]]:
    """(RL step metrics, warm-up metrics) of `mcore-rl demo ARGS --out tmp_path`."""
    proc = subprocess.run([sys.executable, "-m", "mcore_rl.cli", "demo", "--out", str(tmp_path),
                           *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def rows(name):
        path = tmp_path / name
        return ([json.loads(line) for line in path.read_text().splitlines()]
                if path.is_file() else [])  # no warm-up: no warm-up metrics

    return rows("metrics.jsonl"), rows("warmup_metrics.jsonl")


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def test_tool_demo_learns_to_call_and_copy(tmp_path):
    steps, warmup = run_demo(tmp_path, "--task", "tool_calc", "steps=16")
    assert [r["step"] for r in steps] == list(range(1, 17))
    # the warm-up stopped on the accuracy RL samples (T=1), so RL starts with a signal
    assert warmup[-1]["accuracy"] >= 0.05, warmup[-1]
    first, last = steps[:3], steps[-5:]
    # reward rises (when the warm-up stopped on greedy accuracy: 0.005 -> 0.000 on this seed)
    assert mean(last, "reward_mean") >= mean(first, "reward_mean") + 0.25, \
        [r["reward_mean"] for r in steps]
    # ... by calling the calculator well: more calls, no more of them failing
    assert mean(last, "tool_calls/mean") > mean(first, "tool_calls/mean")
    assert mean(last, "tool_errors/frac") <= mean(first, "tool_errors/frac"), \
        [r["tool_errors/frac"] for r in steps]
    # from the first step, groups whose samples differ in reward carry the gradient
    assert mean(first, "informative_groups_frac") >= 0.1, first
    assert max(r["rollout_logprob_max_diff"] for r in steps) < 1e-4


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """`mcore-rl demo actor.lora.rank=16`: the addition demo's warm-up (the full model), then
    RL of LoRA adapters on the warmed-up base. Returns (run dir, RL steps, warm-up steps)."""
    out = tmp_path_factory.mktemp("lora_demo")
    steps, warmup = run_demo(out, "actor.lora.rank=16", "steps=30", "checkpoint.every=30")
    return out, steps, warmup


def test_addition_demo_learns(tmp_path, lora_run):
    """The addition demo: its warm-up reaches the accuracy it stops at, and RL of the whole
    model from there raises the reward. The warm-up is the one the LoRA run did (the same demo
    config and seed); `model.hf_dir=RUN/warmup_hf warmup.max_steps=0` starts RL from it."""
    warmed_up, _, warmup = lora_run
    assert warmup[-1]["accuracy"] >= 0.7, warmup[-1]
    steps, _ = run_demo(tmp_path, "steps=30", f"model.hf_dir={warmed_up / 'warmup_hf'}",
                        "warmup.max_steps=0")
    first, last = steps[:5], steps[-5:]
    assert mean(last, "reward_mean") >= mean(first, "reward_mean") + 0.15, \
        [r["reward_mean"] for r in steps]


def test_lora_demo_learns_through_the_adapter_sync(lora_run):
    """After the full-model warm-up, RL trains adapters on the frozen warmed-up base and every
    step's sync moves the adapters alone into vLLM's LoRA, whose log-probs equal the actor's.
    The checkpoint names the warmed-up base."""
    tmp_path, steps, _ = lora_run
    first, last = steps[:5], steps[-10:]
    assert mean(last, "reward_mean") >= mean(first, "reward_mean") + 0.03, \
        [r["reward_mean"] for r in steps]
    assert all(r["sync_bytes"] == r["sync_adapter_bytes"] > 0 for r in steps)
    assert max(r["rollout_logprob_max_diff"] for r in steps) < 1e-4
    lora = json.loads((tmp_path / "checkpoints" / "step_30" / "actor" / "lora.json")
                      .read_text())
    assert (lora["rank"], lora["base_model"]) == (16, str(tmp_path / "warmup_hf"))
