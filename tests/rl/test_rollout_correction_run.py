"""Rollout correction in a real controller run (vLLM + Megatron on Ray, on-policy with exact
weight sync): TIS and MIS change nothing there (weights 1, nothing masked or clipped), and
bypass takes the engine's log-probs as the old policy — no old-log-prob pass runs, and the
mismatch check comes from the update's own forward."""

import dataclasses

from mcore_rl.config import load_config
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED


def _with_correction(cfg, **fields):
    algo = cfg.algorithm
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(
        algo, rollout_correction=dataclasses.replace(algo.rollout_correction, **fields)))


def test_on_policy_correction_is_identity_and_bypass_skips_old_logprobs(ray_cluster, tmp_path):
    from mcore_rl.rl.controller import RLController
    from mcore_rl.run.lifecycle import build_demo_model

    cfg = load_config(RLConfig, DEMO_SIZED, [
        "warmup.max_steps=0", "steps=4", "prompts_per_step=4", "samples_per_prompt=4",
        "updates_per_batch=1", "train.micro_batch_size=8", "actor.tp=1",
        "train.optimizer.lr=0.01", "deadlines.train_s=240",
        "task.reward_fn=tests.support.rewards:spread_reward"])
    model_dir = build_demo_model(cfg, tmp_path / "model")
    passes = []

    # one run, a correction per step (the controller reads cfg.algorithm each step)
    steps = {1: _with_correction(cfg, mode="mis", level="sequence", low=0.999, high=1.001),
             2: _with_correction(cfg, mode="tis", clip=1.001),
             3: _with_correction(cfg, mode="bypass"),
             4: _with_correction(cfg, mode="bypass")}
    controller = RLController(cfg, model_dir, tmp_path / "run")
    per_token = controller.actors.per_token

    def counting(method, batch, phase, **kwargs):  # the actor's forward-only passes, by name
        passes.append(method)
        return per_token(method, batch, phase, **kwargs)

    controller.actors.per_token = counting
    try:
        controller.reset_optimizer()
        controller.sync_weights()
        metrics = {}
        for step, step_cfg in steps.items():
            controller.cfg = step_cfg
            passes.clear()
            if step == 3:  # no sync after step 3: step 4 samples from weights an update old
                controller.sync_weights = dict
            metrics[step] = controller.rl_step(step)
            metrics[step]["passes"] = list(passes)
    finally:
        controller.shutdown()
    for step in (1, 2):  # the engine serves exactly the actor's weights
        m = metrics[step]
        assert m["mismatch/masked_frac"] == 0 and m["mismatch/clipped_frac"] == 0, m
        assert abs(m["mismatch/is_weight_mean"] - 1) < 1e-4, m
        assert m["mismatch/logprob_abs_diff"] < 1e-5, m
        assert m["passes"] == ["logprobs"] and "timing_s/old_logprob" in m
        assert m["grad_norm"] > 0
    bypass = metrics[3]
    assert bypass["passes"] == [] and "timing_s/old_logprob" not in bypass
    assert "mismatch/is_weight_mean" not in bypass and bypass["grad_norm"] > 0
    # without the pass, the first mini-batch's update forward measures the mismatch: ~0 on
    # synced weights, and the policy's movement when the engine missed a sync
    assert bypass["rollout_logprob_max_diff"] < 1e-4, bypass
    assert metrics[4]["rollout_logprob_max_diff"] > 1e-3, metrics[4]
