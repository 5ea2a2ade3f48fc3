"""The addition demo learns: shortened runs of `mcore-rl demo` (the real CLI: warm-up, Megatron
actor, vLLM engines, streamed sync, GRPO) whose reward must rise, with the whole model and with
LoRA adapters from the same warm-up (the multi-turn tool demo: test_tool_demo_learns.py).

These guard the learning dynamics, which the unit tests of the loss, the masks and the engine's
log-probs cannot. Each run is cut to what shows the rise in under two minutes here; the full
demos stay out of CI. The held-out evaluation (`eval.every`) runs where a test reads it (the
full-model run); the LoRA run turns it off, as it only measures the weights and never changes
what is trained."""

from __future__ import annotations

import json

import pytest

from tests.support.demo_runs import evaluations, mean, run_demo

# end-to-end CLI runs that load every core: run apart from the other such files on the
# parallel workers (tests/support/scheduling.py's WHOLE_MACHINE)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """`mcore-rl demo actor.lora.rank=8`: the addition demo's warm-up (the full model), then
    RL of LoRA adapters (the demo YAML's targets: every decoder linear and the output layer)
    on the warmed-up base. Returns (run dir, RL steps, warm-up steps). Its one checkpoint is
    the one every run writes after its last step (checkpoint.every's default, 50, is past the
    30 steps). No held-out evaluation (the full run reads the addition demo's); the warm-up's
    own accuracy checks are not evaluations."""
    out = tmp_path_factory.mktemp("lora_demo")
    steps, warmup = run_demo(out, "actor.lora.rank=8", "steps=30", "eval.every=0")
    return out, steps, warmup


@pytest.fixture(scope="module")
def full_run(lora_run, tmp_path_factory):
    """RL of the whole model from the LoRA run's warm-up (the same demo config and seed):
    `model.hf_dir=RUN/warmup_hf warmup.max_steps=0`. Returns (run dir, RL steps)."""
    warmed_up, _, _ = lora_run
    out = tmp_path_factory.mktemp("full_demo")
    steps, _ = run_demo(out, "steps=30", f"model.hf_dir={warmed_up / 'warmup_hf'}",
                        "warmup.max_steps=0")
    return out, steps


def rise(steps: list[dict]) -> float:
    """Mean reward of the last 5 steps minus that of the first 5."""
    return mean(steps[-5:], "reward_mean") - mean(steps[:5], "reward_mean")


def test_addition_demo_learns(lora_run, full_run):
    """The addition demo: its warm-up reaches the accuracy it stops at, and RL of the whole
    model from there raises the reward."""
    _, _, warmup = lora_run
    tmp_path, steps = full_run
    assert warmup[-1]["accuracy"] >= 0.7, warmup[-1]
    assert rise(steps) >= 0.15, [r["reward_mean"] for r in steps]
    # evaluations (eval.every 10, before_train): on the starting weights as step 0, then
    # after steps 10, 20, 30, on the weights each step synced
    evals = evaluations(tmp_path)
    assert sorted(evals) == [0, 10, 20, 30]
    assert [r["step"] for r in steps] == list(range(1, 31))
    # step 0 holds the warm-up's weights, and the held-out prompts and greedy reward are the
    # warm-up's own evaluation's: the same accuracy
    assert evals[0]["eval/reward_mean"] == pytest.approx(warmup[-1]["accuracy"], abs=0.01)
    for r in evals.values():
        assert r["eval/prompts"] == 256 and r["eval/reward_errors"] == 0
        assert r["eval/pass@1"] == r["eval/reward_mean"]  # exact-match 0/1 rewards, greedy
        assert 3 <= r["eval/response_length"] <= 5 and r["timing_s/eval"] > 0
    # generations a person can read: 4 samples of steps 10, 20, 30 and of each evaluation
    shown = [json.loads(line) for line in (tmp_path / "generations.jsonl").open()]
    assert [(g["step"], g["kind"]) for g in shown][::4] == [
        (0, "eval"), (10, "train"), (10, "eval"), (20, "train"), (20, "eval"), (30, "train"),
        (30, "eval")]
    for g in shown:  # the addition reward: 1 exactly for the answer and EOS
        assert g["reward"] == float(g["response"] == g["answer"] + "</s>"), g
        assert g["prompt"].endswith("=") and len(g["answer"]) == 3
    assert any((tmp_path / "tb" / "generations").glob("events.out.tfevents.*"))


def test_lora_demo_learns_through_the_adapter_sync(lora_run, full_run, tmp_path_factory):
    """After the full-model warm-up, RL trains adapters on the frozen warmed-up base and every
    step's sync moves the adapters alone into vLLM's LoRA, whose log-probs equal the actor's.
    The checkpoint names the warmed-up base; `mcore-rl export` makes it the merged model,
    whose logits are the warmed-up base's with the run's adapters (PEFT)."""
    tmp_path, steps, _ = lora_run
    _, full = full_run
    # the adapters learn at least half what the whole model does from the same warm-up ...
    assert rise(steps) >= 0.5 * rise(full) > 0, ([r["reward_mean"] for r in steps],
                                                 [r["reward_mean"] for r in full])
    # ... with syncs of the adapters alone, a tenth of the model's bytes or less
    assert all(r["sync_bytes"] == r["sync_adapter_bytes"] > 0 for r in steps)
    assert steps[-1]["sync_bytes"] <= 0.1 * full[-1]["sync_bytes"]
    assert max(r["rollout_logprob_max_diff"] for r in steps) < 1e-4
    lora = json.loads((tmp_path / "checkpoints" / "step_30" / "actor" / "lora.json")
                      .read_text())
    assert (lora["rank"], lora["base_model"]) == (8, str(tmp_path / "warmup_hf"))
    assert "output_layer" in lora["targets"]
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*")] == ["step_30"]
    _export_is_the_base_with_the_adapters(tmp_path, tmp_path_factory.mktemp("lora_export"))


def _export_is_the_base_with_the_adapters(run_dir, out):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mcore_rl.cli import main
    from mcore_rl.conversion.peft_adapter import mcore_to_peft

    assert main(["export", str(run_dir), str(out / "merged"), "--no-progress"]) == 0
    peft_dir = mcore_to_peft(run_dir / "checkpoints" / "step_30" / "actor", out / "peft")

    def model(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                    local_files_only=True).eval()

    tokens = torch.randint(0, 16, (4, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(run_dir / "warmup_hf")
        base_logits = base(tokens).logits
        want = PeftModel.from_pretrained(base, str(peft_dir)).eval()(tokens).logits
        got = model(out / "merged")(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - base_logits).abs().max() > 1e-3  # the adapters learned something
