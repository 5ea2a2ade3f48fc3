"""A Megatron MoE actor (Qwen3-MoE, EP2) → vLLM through the streamed sync, checked against HF
transformers: after one update and a sync, vLLM (CPU, fused MoE experts re-installed and
re-packed by `rollout.moe_install`) samples with the log-probs HF computes on the actor's
weights (rebuilt from the actor's shards with the layout tables)."""

import torch

from mcore_rl.config import load_config
from mcore_rl.run.config import RLConfig

from .test_sync_integration import BASE
from tests.support import DEMO_SIZED
from tests.support.rl_runs import step_then_sample


def hf_model_from_state(model_dir, state, out):
    """HF transformers on `state` (HF names), loaded from a folder: transformers 5 fuses a
    layer's experts in memory, so per-expert tensors load only through from_pretrained."""
    import shutil

    from safetensors.torch import save_file

    from mcore_rl.models.hf_reference import load_hf_model

    out.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copyfile(f, out / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return load_hf_model(out)

MOE = ["model.experts=4", "model.experts_per_token=2", "model.expert_ffn=64", "model.layers=2"]


def test_megatron_ep2_to_vllm_matches_hf(tmp_path):
    from mcore_rl.layouts import assemble_hf, megatron_shards
    from mcore_rl.models.hf_reference import load_hf_model, token_logprobs
    from mcore_rl.run.train import build_demo_model

    cfg = load_config(RLConfig, DEMO_SIZED, BASE + MOE + ["actor.tp=1", "actor.dp=2", "actor.ep=2",
                                                    "rollout.tp=2"])
    model_dir = build_demo_model(cfg, tmp_path)
    run = step_then_sample(cfg, model_dir, tmp_path)
    prompts, sampled = run["prompts"], run["sampled"]
    assert run["step"]["grad_norm"] > 0  # the actor updated, then synced
    hf_state = assemble_hf(megatron_shards(run["spec"], cfg.actor), run["shards"])
    model = hf_model_from_state(model_dir, hf_state, tmp_path / "synced")
    before = load_hf_model(model_dir)              # the weights vLLM started from
    worst, stale = 0.0, 0.0
    for prompt, outs in zip(prompts, sampled):
        for c in outs:
            seq = [prompt + list(c.token_ids)]
            hf = token_logprobs(model, seq)[0][len(prompt) - 1:]
            old = token_logprobs(before, seq)[0][len(prompt) - 1:]
            worst = max(worst, float((torch.tensor(c.logprobs) - hf).abs().max()))
            stale = max(stale, float((torch.tensor(c.logprobs) - old).abs().max()))
    print(f"vLLM vs actor log-probs after the sync: max |diff| {worst:.2e} "
          f"(vs the pre-update weights: {stale:.2e})")
    assert worst < 1e-4, worst
    assert stale > 1e-3, stale                     # the update did change what vLLM computes
