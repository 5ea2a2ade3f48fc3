"""A short RL run (`run.lifecycle.RLRun`), optionally resumed from or saving a checkpoint —
shared by the resume tests (on- and off-policy) — and one step then samples, for the sync
checks."""

from __future__ import annotations

DETERMINISTIC = ("reward_mean", "pg_loss", "clip_frac", "ppo_kl", "entropy", "grad_norm",
                 "response_length")


def run_steps(cfg, model_dir, out, steps, *, resume_from=None, save_at=None):
    """RL steps `steps` (after loading `resume_from` when given, which must have been taken
    after steps[0] - 1). Returns (metrics by step, actor weight digests, the checkpoint written
    after step `save_at` or None)."""
    from mcore_rl.run.lifecycle import RLRun

    with RLRun(cfg, out, model_dir=model_dir) as run:
        assert run.begin(resume_from) == steps[0]
        metrics = {}
        checkpoint = run.train(steps, metrics.__setitem__,
                               checkpoint_due=lambda step: step == save_at)
        return metrics, run.controller.weights_digests(), checkpoint


def step_then_sample(cfg, model_dir, out, *, greedy: bool = False, sft_steps: int = 0) -> dict:
    """`stepped_and_sampled` on a run of its own, started here and shut down."""
    from mcore_rl.run.lifecycle import RLRun

    with RLRun(cfg, out, model_dir=model_dir) as run:
        return stepped_and_sampled(run.controller, greedy=greedy, sft_steps=sft_steps)


def stepped_and_sampled(controller, *, greedy: bool = False, sft_steps: int = 0) -> dict:
    """One RL step (the actor updates, then syncs), then the engines sample 8 held-out prompts
    (`heldout_samples`). sft_steps: warm-up steps first (the whole model trains, nothing
    synced). Returns the step's metrics, the first sync's, the actor's shards per rank, the
    prompts, the samples, the greedy outputs (or None), the model spec and the resolved run —
    what the sync-vs-HF checks compare."""
    for k in range(1, sft_steps + 1):
        controller.sft_step(controller.sampler.warmup_batch(k))
    controller.reset_optimizer()
    first_sync = controller.sync_weights()
    step = controller.rl_step(1)
    return {"step": step, "first_sync": first_sync, "shards": actor_shards(controller),
            **heldout_samples(controller, greedy=greedy), "spec": controller.spec,
            "run": controller.run}


def actor_shards(controller) -> dict[int, dict]:
    """The actor's weights as each rank holds them (its Megatron shards), by rank."""
    return dict(enumerate(controller.call_actors("export_weights", phase="save")))


def heldout_samples(controller, *, greedy: bool = False) -> dict:
    """The engines' samples of 8 held-out prompts (T=1, two samples each, seed 5, 5 tokens;
    with `greedy`, also greedy): {"prompts", "sampled", "greedy" (or None)}."""
    from mcore_rl.rollout.engine import SamplingConfig
    from mcore_rl.tasks.tokenizer import encode_prompt

    sampler = controller.sampler
    prompts = [encode_prompt(sampler.tokenizer, t)
               for t in sampler.task.heldout_prompts(8, seed=3)]
    sampled = sampler.generate(prompts, SamplingConfig(temperature=1.0, n=2, seed=5,
                                                       max_tokens=5))
    greedy_outs = (sampler.generate(prompts, SamplingConfig(temperature=0.0, max_tokens=5))
                   if greedy else None)
    return {"prompts": prompts, "sampled": sampled, "greedy": greedy_outs}


def sampled_logprob_gap(model, prompts, sampled) -> float:
    """The largest |engine log-prob − HF log-prob| over the sampled tokens, HF's computed by
    `model` (an HF causal LM with the weights the engines should hold)."""
    import torch

    from mcore_rl.models.hf_reference import token_logprobs

    worst = 0.0
    for prompt, outs in zip(prompts, sampled):
        for c in outs:
            hf = token_logprobs(model, [prompt + list(c.token_ids)])[0][len(prompt) - 1:]
            worst = max(worst, float((torch.tensor(c.logprobs) - hf).abs().max()))
    return worst
