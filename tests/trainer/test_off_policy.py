"""One-step off-policy GRPO: the engines generate step n+1's batch while the actor trains step
n. Checked end to end with real vLLM and the Megatron actor on Ray: the generation really
overlaps training, each batch comes from the weights one update behind (the engine's
log-probs of its samples then differ from the actor's), and a run resumed from a checkpoint
(which carries the batch already generated) reproduces the uninterrupted run exactly."""

from mcore_rl.config import load_config
from mcore_rl.trainer.rl_config import RLConfig
from .rl_runs import DETERMINISTIC as BASE_DETERMINISTIC
from .rl_runs import run_steps

DETERMINISTIC = BASE_DETERMINISTIC + ("rollout_logprob_max_diff",)


def test_one_step_off_policy_overlaps_and_resumes_exactly(tmp_path):
    from mcore_rl.trainer.demo import build_demo_model

    cfg = load_config(RLConfig, None, [
        "off_policy_steps=1", "warmup.max_steps=0", "steps=4", "prompts_per_step=4",
        "samples_per_prompt=4", "updates_per_batch=1", "train.micro_batch_size=8",
        "actor.tp=1", "train.optimizer.lr=0.01", "deadlines.train_s=240",
        "task.reward_fn=mcore_rl.tasks.addition:digit_reward"])
    model_dir = build_demo_model(cfg, tmp_path / "model")

    full, full_digest, checkpoint = run_steps(cfg, model_dir, tmp_path / "full", (1, 2, 3, 4),
                                              save_at=2)
    # overlap: the next batch was generating while this step trained (not on the last step)
    for step in (1, 2, 3):
        assert full[step]["gen_overlap_s"] > 0, (step, full[step])
    assert "gen_overlap_s" not in full[4]
    # staleness: batch 1 came from the actor's own weights, later ones from one update back
    assert full[1]["rollout_logprob_max_diff"] < 1e-4
    for step in (2, 3, 4):
        assert full[step]["rollout_logprob_max_diff"] > 1e-3, (step, full[step])
    for step in full:
        assert full[step]["timing_s/gen"] > 0 and "timing_s/gen_wait" in full[step]

    # the checkpoint after step 2 carries step 3's batch (generated on step 2's weights)
    assert (checkpoint / "next_rollouts.pt").is_file()
    resumed, resumed_digest, _ = run_steps(cfg, model_dir, tmp_path / "resumed", (3, 4),
                                           resume_from=checkpoint)
    for step in (3, 4):
        for key in DETERMINISTIC:
            assert resumed[step][key] == full[step][key], (step, key)
    assert resumed_digest == full_digest
