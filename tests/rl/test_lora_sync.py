"""An RL step with a LoRA actor (`actor.lora`) through the whole run: the TP2 actor trains its
adapters only, KL against the reference — the base with the adapters off, no model of its
own. After the sync vLLM samples with the log-probs HF computes on the policy's weights
(W + scale·B·A), with either sync:
  merged   the actor streams the merged shards: the adapted weights moved, every other
           weight is still the base's;
  adapter  the actor streams the adapters alone and vLLM applies them (its LoRA): a sync
           moves a small fraction of the model's bytes, and a base a warm-up trained reaches
           the engines once, before the adapters.
With the adapters there from the start, and added when RL starts (a run with a full-model
warm-up: the trainer is re-wrapped so its grad buffers and optimizer hold the adapters
only)."""

import pytest
import torch

from mcore_rl.config import load_config
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED
from tests.support.rl_runs import sampled_logprob_gap, step_then_sample

pytestmark = pytest.mark.slow  # end-to-end: started first on the parallel workers

LORA_STEP = ["steps=1", "prompts_per_step=4", "samples_per_prompt=4",
             "updates_per_batch=2", "train.micro_batch_size=8", "actor.lora.lr=0.05",
             "task.reward_fn=tests.support.rewards:spread_reward", "actor.tp=2",
             "actor.lora.rank=8", "actor.lora.alpha=16", "algorithm.kl_coeff=0.1"]
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def base_weights(model_dir):
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in
            load_file(f).items()}


@pytest.mark.parametrize("warmup_steps", [0, 2], ids=["from-start", "after-warmup"])
def test_lora_actor_step_syncs_merged_weights_and_keeps_the_base(ray_cluster, tmp_path,
                                                                 warmup_steps):
    from mcore_rl.layouts import assemble_hf, megatron_shards
    from mcore_rl.run.lifecycle import build_demo_model
    from tests.rl.test_sync_integration import hf_model_with

    cfg = load_config(RLConfig, DEMO_SIZED, LORA_STEP + [f"warmup.max_steps={warmup_steps}",
                                                         "actor.lora.sync=merged"])
    model_dir = build_demo_model(cfg, tmp_path)
    run = step_then_sample(cfg, model_dir, tmp_path)
    step, prompts, sampled = run["step"], run["prompts"], run["sampled"]
    assert step["grad_norm"] > 0
    # the second update's policy differs from the base: the KL against it is measured
    assert step["kl_ref"] > 0
    merged = assemble_hf(megatron_shards(run["spec"], cfg.actor), run["shards"])
    base = base_weights(model_dir)
    moved = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert moved and all(k.split(".")[-2] in ADAPTED for k in moved)
    assert any(k.endswith("embed_tokens.weight") for k in set(merged) - moved)
    model = hf_model_with(model_dir, merged)
    worst = sampled_logprob_gap(model, prompts, sampled)
    assert worst < 1e-4, worst


@pytest.mark.parametrize("sft_steps", [0, 1], ids=["from-start", "after-warmup"])
def test_lora_actor_step_syncs_the_adapters_alone_into_vllms_lora(ray_cluster, tmp_path,
                                                                  sft_steps):
    from mcore_rl.layouts import assemble_hf, megatron_shards
    from mcore_rl.run.lifecycle import build_demo_model
    from tests.rl.test_sync_integration import hf_model_with

    cfg = load_config(RLConfig, DEMO_SIZED, LORA_STEP + [f"warmup.max_steps={2 * sft_steps}",
                                                         "actor.lora.sync=adapter"])
    model_dir = build_demo_model(cfg, tmp_path)
    run = step_then_sample(cfg, model_dir, tmp_path, sft_steps=sft_steps)
    step, first = run["step"], run["first_sync"]
    assert step["grad_norm"] > 0 and step["kl_ref"] > 0
    policy = assemble_hf(megatron_shards(run["spec"], cfg.actor), run["shards"])
    model_bytes = 4 * sum(t.numel() for t in policy.values())
    # the step's sync: the adapters alone, a small fraction of the model
    assert step["sync_bytes"] == step["sync_adapter_bytes"] > 0
    assert step["sync_adapter_bytes"] * 10 < model_bytes
    # the first sync: the base too when the warm-up trained it, else the adapters alone
    base_sent = first["sync_bytes"] - first["sync_adapter_bytes"]
    assert base_sent == (model_bytes if sft_steps else 0)
    if sft_steps:  # the base the engines loaded is not the actor's any more
        base = base_weights(model_dir)
        assert not torch.equal(policy["model.embed_tokens.weight"],
                               base["model.embed_tokens.weight"])
    worst = sampled_logprob_gap(hf_model_with(model_dir, policy), run["prompts"], run["sampled"])
    assert worst < 1e-4, worst
    if not sft_steps:  # the engines did not sample from the base: the adapters arrived
        without = hf_model_with(model_dir, base_weights(model_dir))
        assert sampled_logprob_gap(without, run["prompts"], run["sampled"]) > 1e-3
