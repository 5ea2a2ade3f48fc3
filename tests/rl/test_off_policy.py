"""Generation ahead of training (rollout.mode async, k = 2, with TIS): checked end to end with
real vLLM and the Megatron actor on Ray. Each batch comes from weights at most k updates
behind (exactly min(step - 1, k) with the deterministic schedule), the generation really
overlaps training, the engine's log-probs of stale samples differ from the actor's (and TIS
weights them), and a run resumed from a checkpoint — which carries the buffer of batches
already generated, with their versions — reproduces the uninterrupted run exactly.

With partial rollouts (`rollout.partial_chunk_tokens`) the batches ahead are generated 2 tokens
per weight version and continued on the new weights after each sync: the samples then mix
versions, the tokens made on the actor's own weights carry the actor's log-probs (so each
recorded log-prob is its version's), and the checkpoint carries the unfinished generations."""

import pytest

from mcore_rl.config import load_config
from mcore_rl.runconfig import RLConfig
from tests.support.rl_runs import DETERMINISTIC as BASE_DETERMINISTIC
from tests.support.rl_runs import run_steps
from tests.support import DEMO_SIZED

pytestmark = pytest.mark.slow  # end-to-end: started first on the parallel workers

DETERMINISTIC = BASE_DETERMINISTIC + (
    "rollout_logprob_max_diff", "staleness/max", "mismatch/is_weight_mean",
    "mismatch/k3_kl", "mismatch/clipped_frac")


@pytest.mark.parametrize("partial", [None, 2], ids=["whole", "partial"])
def test_async_with_staleness_bound_overlaps_and_resumes_exactly(ray_cluster, tmp_path, partial):
    from mcore_rl.run.lifecycle import build_demo_model

    cfg = load_config(RLConfig, DEMO_SIZED, [f"rollout.partial_chunk_tokens={partial or 'null'}",
        "rollout.mode=async", "rollout.max_staleness=2",
        "algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.clip=1.5",
        "warmup.max_steps=0", "steps=5", "prompts_per_step=4",
        "samples_per_prompt=4", "updates_per_batch=1", "train.micro_batch_size=8",
        "actor.tp=1", "train.optimizer.lr=0.01", "deadlines.train_s=240",
        "task.reward_fn=tests.support.rewards:spread_reward"])
    model_dir = build_demo_model(cfg, tmp_path / "model")

    full, full_digest, checkpoint = run_steps(cfg, model_dir, tmp_path / "full",
                                              (1, 2, 3, 4, 5), save_at=3)
    for step, m in full.items():
        # trained at version step - 1 on a batch of version max(0, step - 3)
        assert m["staleness/max"] == min(step - 1, 2) and m["staleness/dropped"] == 0, step
        assert m["timing_s/gen"] > 0 and "timing_s/gen_wait" in m
    # overlap: batches ahead were generating while these steps trained (step 5 queues none)
    for step in (1, 2, 3):
        assert full[step]["gen_overlap_s"] > 0, (step, full[step])
    assert "gen_overlap_s" not in full[5]
    # batch 1 came from the actor's own weights: TIS weights 1; later ones are stale
    assert full[1]["rollout_logprob_max_diff"] < 1e-4
    assert abs(full[1]["mismatch/is_weight_mean"] - 1) < 1e-4
    assert full[1]["mismatch/clipped_frac"] == 0
    for step in (2, 3, 4, 5):
        assert full[step]["rollout_logprob_max_diff"] > 1e-3, (step, full[step])
        assert full[step]["mismatch/k3_kl"] > full[1]["mismatch/k3_kl"]
    keys = DETERMINISTIC
    if partial:
        keys += ("staleness/mean", "partial/current_version_logprob_max_diff")
        for step, m in full.items():
            # tokens made on the weights the actor trains at: their log-probs are the actor's
            assert m["partial/current_version_logprob_max_diff"] < 1e-4, (step, m)
            if step > 1:  # samples span versions: most tokens are newer than the oldest
                assert m["staleness/mean"] < m["staleness/max"], (step, m)

    # the checkpoint after step 3 carries batches 4 and 5 (versions 1 and 2)
    assert (checkpoint / "rollout_buffer.pt").is_file()
    resumed, resumed_digest, _ = run_steps(cfg, model_dir, tmp_path / "resumed", (4, 5),
                                           resume_from=checkpoint)
    for step in (4, 5):
        for key in keys:
            assert resumed[step][key] == full[step][key], (step, key)
    assert resumed_digest == full_digest


def test_free_running_async_keeps_the_staleness_bound(ray_cluster, tmp_path):
    """rollout.deterministic=false: the sync waits only for the generation running then; every
    batch still comes from weights at most k = 2 updates behind, and the checkpoint's buffer
    records the version each batch ahead was generated on."""
    import torch

    from mcore_rl.run.lifecycle import build_demo_model

    cfg = load_config(RLConfig, "configs/tiny_ci.yaml", [
        "rollout.mode=async", "rollout.max_staleness=2", "rollout.deterministic=false",
        "algorithm.rollout_correction.mode=tis", "steps=4", "actor.tp=1",
        "deadlines.train_s=240", "task.reward_fn=tests.support.rewards:spread_reward"])
    model_dir = build_demo_model(cfg, tmp_path / "model")
    metrics, _, checkpoint = run_steps(cfg, model_dir, tmp_path / "run", (1, 2, 3, 4),
                                       save_at=2)
    for step, m in metrics.items():
        assert 0 <= m["staleness/max"] <= min(step - 1, 2), (step, m)
        assert m["staleness/dropped"] == 0 and m["timing_s/gen"] > 0, (step, m)
    buffer = torch.load(checkpoint / "rollout_buffer.pt", weights_only=True)
    # after step 2 the engines hold version 2; batches 3 and 4 were queued at versions >= 1
    assert [b["step"] for b in buffer["batches"]] == [3, 4]
    for saved in buffer["batches"]:
        assert saved["step"] - 1 - 2 <= saved["version"] <= 2, saved
