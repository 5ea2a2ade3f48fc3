"""The controller on a multi-turn task, end to end (Megatron actor TP2 on Ray, vLLM, streamed
sync, packed micro batches; PPO, so the critic and the reference run on the multi-turn
sequences too): the engine's log-probs of every model token — also those that come after
observations — equal the actor's on the synced weights, observation tokens are in the
sequences but out of the loss, and the episode metrics are reported. (GRPO on multi-turn
episodes is what `mcore-rl demo --task tool_calc` runs.)"""

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED

MULTI_TURN = ["task.kind=tool_calc", "task.env=tests.support.scripted_env:three_turn_env",
              "task.episode.max_turns=3", "task.episode.max_total_tokens=40",
              "train.seq_len=40", "max_new_tokens=6", "warmup.max_steps=0", "steps=2",
              "prompts_per_step=4", "samples_per_prompt=4", "updates_per_batch=2",
              "train.micro_batch_size=4", "train.max_tokens_per_micro_batch=80",
              "deadlines.train_s=240", "actor.tp=2", "rollout.max_num_batched_tokens=640"]
# PPO: critic (GAE over model tokens only) and a frozen reference with a KL loss term
PPO = ["algorithm.advantage_estimator=gae", "algorithm.kl_coeff=0.05",
       "critic_train.seq_len=40", "critic_train.max_tokens_per_micro_batch=80"]


def test_episode_must_fit_the_rows_and_one_engine_step():
    with pytest.raises(ConfigError, match=r"task.episode.max_total_tokens=40: an episode must "
                                          r"fit train.seq_len \+ 1=33"):
        load_config(RLConfig, DEMO_SIZED, [*MULTI_TURN, "train.seq_len=32"])
    with pytest.raises(ConfigError, match=r"rollout.max_num_batched_tokens=320: .* up to 16 "
                                          r"contexts of up to 40 tokens: set >= 640"):
        load_config(RLConfig, DEMO_SIZED, [*MULTI_TURN, "rollout.max_num_batched_tokens=320"])
    # two engines halve each call, but while a late one starts, engine 0 takes all 16
    load_config(RLConfig, DEMO_SIZED, [*MULTI_TURN, "rollout.max_num_batched_tokens=320",
                                 "rollout.engines=2"])
    with pytest.raises(ConfigError, match=r"up to 16 contexts of up to 40 tokens"):
        load_config(RLConfig, DEMO_SIZED, [*MULTI_TURN, "rollout.max_num_batched_tokens=320",
                                     "rollout.engines=2", "rollout.startup_engines=1"])


def test_multi_turn_steps_through_the_controller(ray_cluster, tmp_path):
    from mcore_rl.launch.timing import PhaseTimer
    from mcore_rl.run.lifecycle import RLRun, build_demo_model
    from tests.support.scripted_env import OBSERVATION

    cfg = load_config(RLConfig, DEMO_SIZED, [*MULTI_TURN, *PPO])
    model_dir = build_demo_model(cfg, tmp_path)
    with RLRun(cfg, tmp_path, model_dir=model_dir) as run:
        controller = run.controller
        run.begin()
        rollouts = controller.sampler.collect(1, PhaseTimer())
        steps = [controller.rl_step(step) for step in (1, 2)]
        obs = controller.sampler.tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    episodes = [e for group in rollouts.completions for e in group]
    assert len(episodes) == 16
    for e in episodes:
        assert e.turns == 3 and e.finish_reason == "done" and e.tool_calls == 2
        assert e.observed_tokens == 2 * len(obs) and len(e.logprobs) == e.model_tokens
        # the observation sits between model turns, masked out
        first = e.loss_mask.index(0)
        assert list(e.token_ids[first:first + len(obs)]) == obs
        assert e.loss_mask[first:first + len(obs)] == (0,) * len(obs)
    assert [list(e.prompt_ids) for e in episodes[::4]] == rollouts.prompt_ids
    for m in steps:
        # vLLM sampled every model token from exactly the actor's weights, also after the
        # observations it never generated (fp32)
        assert m["rollout_logprob_max_diff"] < 1e-4, m["rollout_logprob_max_diff"]
        assert m["turns/mean"] == 3.0 and m["tool_calls/mean"] == 2.0
        assert m["tool_errors/frac"] == 0.5
        assert m["tokens/observed"] == 16 * 2 * len(obs)
        # the loss counted model tokens only
        assert m["response_length"] == m["tokens/generated"] / 16
        assert m["micro_batches"] >= 1 and m["grad_norm"] > 0
        assert m["kl_ref"] >= 0 and m["vf_loss"] > 0 and m["critic_grad_norm"] > 0
        assert all(f"timing_s/{p}" in m for p in ("ref", "values", "update_critic"))
