"""A short RL run through RLController, optionally resumed from or saving a checkpoint —
shared by the resume tests (on- and off-policy)."""

from __future__ import annotations

DETERMINISTIC = ("reward_mean", "pg_loss", "clip_frac", "ppo_kl", "entropy", "grad_norm",
                 "response_length")


def run_steps(cfg, model_dir, out, steps, *, resume_from=None, save_at=None):
    """RL steps `steps` (after loading `resume_from` when given, which must have been taken
    after steps[0] - 1). Returns (metrics by step, actor weight digests, the checkpoint written
    after step `save_at` or None)."""
    from mcore_rl.rl.controller import RLController
    from mcore_rl.run.loop import run_steps

    controller = RLController(cfg, model_dir, out)
    try:
        controller.reset_optimizer()
        if resume_from is not None:
            assert controller.load_checkpoint(resume_from) == steps[0] - 1
        controller.sync_weights()
        metrics = {}
        checkpoint = run_steps(controller, steps, metrics.__setitem__,
                               checkpoint_due=lambda step: step == save_at)
        return metrics, controller.weights_digests(), checkpoint
    finally:
        controller.shutdown()
