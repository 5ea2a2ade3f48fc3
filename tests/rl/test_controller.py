"""GRPO steps end to end: Megatron actor (TP2, and PP2) on Ray, a real vLLM engine, streamed
weight sync. The engine's log-probs of its own samples must equal the actor's log-probs on the
synced weights — the end-to-end check that the sync installs exactly the actor's weights —
and every phase is timed on its own."""

import json

import pytest

from mcore_rl.config import load_config
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED

pytestmark = pytest.mark.slow  # end-to-end: started first on the parallel workers

PHASES = ("gen", "reward", "old_logprob", "adv", "update_actor", "sync", "step")


def small_config(*overrides):
    return load_config(RLConfig, DEMO_SIZED, [
        "warmup.max_steps=0", "steps=2", "prompts_per_step=4", "samples_per_prompt=4",
        "updates_per_batch=2", "train.micro_batch_size=4", "deadlines.train_s=240", *overrides])


# GRPO with DAPO dynamic sampling (all-equal groups dropped, more prompts drawn)
GRPO = ["algorithm.advantage_estimator=grpo", "algorithm.dynamic_sampling=true",
        "task.reward_fn=mcore_rl.tasks.addition:digit_reward"]
# PPO: critic with GAE, KL to a frozen reference as a loss term (k3)
PPO = ["algorithm.advantage_estimator=gae", "algorithm.kl_coeff=0.05",
       "critic_train.micro_batch_size=4"]


def assert_export_round_trips(controller, model_dir, out):
    """The HF export of the untrained actor (run.hf_export) is the starting checkpoint,
    bit for bit, with its config and tokenizer files."""
    from safetensors.torch import load_file

    from mcore_rl.run.hf_export import export_actor_hf

    exported = load_file(export_actor_hf(controller, model_dir, out) / "model.safetensors")
    source = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        source.update(load_file(path))
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and exported[name].equal(tensor), name
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert not list(out.parent.glob(".export.tmp"))


# Each grid once and each algorithm once (the grid × algorithm square ran the same controller
# path twice over): the critic and the reference at TP2 are also trained through megatron's
# schedules by tests/megatron/test_policy.py, and dynamic sampling is the controller's,
# whatever the grid.
@pytest.mark.parametrize("grid,algo", [(["actor.tp=2"], GRPO),
                                       (["actor.tp=1", "actor.pp=2"], PPO)],
                         ids=["actor-tp2-grpo", "actor-pp2-ppo"])
def test_two_rl_steps_with_vllm_and_streamed_sync(ray_cluster, tmp_path, grid, algo):
    from mcore_rl.rl.metrics import MetricsWriter, plot_run
    from mcore_rl.run.lifecycle import RLRun, build_demo_model

    cfg = small_config(*grid, *algo)
    model_dir = build_demo_model(cfg, tmp_path)
    with RLRun(cfg, tmp_path, model_dir=model_dir) as run:
        assert_export_round_trips(run.controller, model_dir, tmp_path / "export")
        # the RL optimizer (as the demo's after its warm-up), then the first sync
        assert run.begin() == 1
        writer, steps = MetricsWriter(tmp_path), []

        def record(step: int, metrics: dict) -> None:
            writer.write(step, metrics)
            steps.append(metrics)

        run.train((1, 2), record)
        writer.close()
    phases = PHASES + (("ref", "values", "update_critic") if algo is PPO else ())
    for m in steps:
        assert all(f"timing_s/{p}" in m for p in phases)
        parts = sum(m[f"timing_s/{p}"] for p in phases if p != "step")
        assert parts <= m["timing_s/step"] + 1e-6  # phases never overlap or double-bill
        assert m["sync_bytes"] > 0
        # vLLM sampled from exactly the actor's weights (fp32)
        assert m["rollout_logprob_max_diff"] < 1e-4, m["rollout_logprob_max_diff"]
        # the first of the 2 mini-batches took π_old from its own update forward
        # (algorithm.old_logprob_from_update): the pass ran on the other 8 of 16 rows
        assert m["old_logprob_rows"] == 8
        if algo is PPO:
            assert "vf_loss" in m and m["kl_ref"] >= 0
        else:  # dynamic sampling filled the batch with groups that carry a gradient
            assert m["informative_groups_frac"] == 1.0, m
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and "reward_mean" in records[0]
    assert all(p.is_file() for p in plot_run(tmp_path))


def test_colocated_placement_sleeps_engines_and_packs(ray_cluster, tmp_path):
    """Colocated: each device holds an actor rank and an engine rank (one placement-group
    bundle per node); the engines sleep through training and wake for the sync (vLLM's
    sleep is a no-op on CPU: this is the placement and ordering, the memory freeing is
    GPU-only). Micro batches are packed by a token budget through the Ray workers."""
    from mcore_rl.run.lifecycle import RLRun, build_demo_model

    cfg = small_config(
        "actor.tp=2", "rollout.engines=2", "rollout.enable_sleep=true",
        "cluster.device=cpu", "cluster.gpus_per_node=2", "cluster.device_gib=8",
        "cluster.reserve_gib=0", "cluster.placement=colocated", "sync.backend=gloo",
        "train.max_tokens_per_micro_batch=96", *GRPO)
    model_dir = build_demo_model(cfg, tmp_path)
    with RLRun(cfg, tmp_path, model_dir=model_dir) as run:
        controller = run.controller
        run.begin()
        steps = [controller.rl_step(step) for step in (1, 2)]
        ranks = controller.actors.call("where", phase="startup")
        engines = controller.engines.where
    group = ranks[0]["placement_group"]
    assert group is not None
    assert all(r["placement_group"] == group for r in ranks + engines)
    assert controller.run.trainers_first  # built before the engines start (issue #30, B6)
    assert [r["slot"] for r in ranks] == [0, 1]
    # each rank computes on the device the run plan resolved for it (C2, issue #30)
    assert [r["device"] for r in ranks] == list(controller.run.actor_devices) == ["cpu"] * 2
    assert [e["devices"] for e in engines] == [[0], [1]]  # engine rank d on actor device d
    for m in steps:
        assert m["timing_s/sleep"] >= 0 and m["timing_s/wake"] >= 0
        assert m["rollout_logprob_max_diff"] < 1e-4  # woken engines got the exact weights
        # colocated engines are refit through the trainer ranks' shared staging buffers (IPC),
        # not sends on the sync group
        assert controller.run.transports == ("ipc", "ipc")
        assert m["sync_bytes_ipc"] == m["sync_bytes"] > 0, m
        # 8 rows of <= 11 tokens per update: one packed micro batch (micro_batch_size 4
        # would run two)
        assert m["micro_batches"] == 1 and m["pack_efficiency"] > 0.5, m


def test_reward_model_scores_rollouts_in_the_loop(ray_cluster, tmp_path):
    """A reward model (TP2 worker group) scores every sample in the reward phase: the
    controller's rewards equal coeff · the HF classifier's score of prompt + response."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from mcore_rl.models.hf_factory import make_hf_reward_model_dir
    from mcore_rl.models.spec import ModelSpec
    from mcore_rl.launch.timing import PhaseTimer
    from mcore_rl.run.lifecycle import RLRun, build_demo_model
    from mcore_rl.tasks.tokenizer import load_tokenizer

    base = ["actor.tp=1", "task.reward_fn=mcore_rl.tasks.base:no_reward"]
    model_dir = build_demo_model(small_config(*base), tmp_path)
    pad = load_tokenizer(model_dir).pad_token_id
    rm_dir = make_hf_reward_model_dir(ModelSpec.from_hf_dir(model_dir), tmp_path / "rm", seed=3,
                                      pad_token_id=pad)
    cfg = small_config(*base, "reward_model.enabled=true", f"reward_model.hf_dir={rm_dir}",
                       "reward_model.parallel.tp=2", "reward_model.coeff=0.5")
    with RLRun(cfg, tmp_path, model_dir=model_dir) as run:
        controller = run.controller
        run.begin()
        rollouts = controller.sampler.collect(1, PhaseTimer())
        metrics = controller.rl_step(2)
        prompts = rollouts.prompt_ids
        assert prompts == [controller.sampler.encode(e.prompt) for e in rollouts.examples]
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, torch_dtype=torch.float32)
    # one unpadded row at a time: its score is at its last token, also when the response ends
    # in a generated pad id (with pad_token_id set HF scores the last token that is not one)
    hf.config.pad_token_id = None
    worst = 0.0
    with torch.no_grad():
        for prompt, group, scores in zip(prompts, rollouts.completions, rollouts.scores):
            for completion, score in zip(group, scores):
                ids = torch.tensor([prompt + list(completion.token_ids)])
                worst = max(worst, abs(score - 0.5 * float(hf(ids).logits[0, 0])))
    assert worst < 1e-5, worst
    assert len({s for g in rollouts.scores for s in g}) > 1  # the model tells samples apart
    assert metrics["reward_std"] > 0 and metrics["grad_norm"] > 0


@pytest.mark.fast  # (the fast tier's one end-to-end RL step: Ray, vLLM, megatron, sync)
def test_bf16_wire_sync_halves_the_bytes(ray_cluster, tmp_path):
    """sync.dtype bf16: the actor's fp32 shards go over the wire as bf16 (half the bytes of
    the plan's fp32 elements) and the fp32 engine installs the rounded weights — its
    log-probs then differ from the actor's by rounding only."""
    from mcore_rl.run.lifecycle import RLRun, build_demo_model

    cfg = small_config("actor.tp=2", "sync.dtype=bf16", *GRPO)
    assert cfg.wire_dtype == "bfloat16"
    model_dir = build_demo_model(cfg, tmp_path)
    with RLRun(cfg, tmp_path, model_dir=model_dir) as run:
        controller = run.controller
        run.begin()
        first = run.first_sync
        step = controller.rl_step(1)
        elements = sum(t.numel for round_ in controller.weight_sync.plan.rounds for t in round_)
    assert controller.weight_sync.plan.element_size == 2
    assert first["sync_bytes"] == step["sync_bytes"] == 2 * elements
    # bf16 keeps 8 mantissa bits: the engine's weights are the actor's, rounded
    assert 0 < step["rollout_logprob_max_diff"] < 0.1, step["rollout_logprob_max_diff"]


@pytest.mark.parametrize("overrides, rows", [
    ([], 8),
    (["updates_per_batch=4", "train.micro_batch_size=2"], 4),
    (["algorithm.old_logprob_from_update=false"], 0),
    (["updates_per_batch=1", "train.micro_batch_size=8"], 0),  # the pass is the mismatch check
    (["algorithm.rollout_correction.mode=tis"], 0),  # weights need every row's π_old
    (["algorithm.advantage_estimator=gae", "algorithm.kl_coeff=0.05",
      "algorithm.kl_mode=reward", "critic_train.micro_batch_size=4"], 0),  # KL rewards too
    (["algorithm.advantage_estimator=gae", "algorithm.kl_coeff=0.05",
      "critic_train.micro_batch_size=4"], 8),  # a KL loss term: fine
])
def test_old_logp_comes_from_the_update_only_where_nothing_needs_it_before(overrides, rows):
    from mcore_rl.rl.controller import RLController

    controller = RLController.__new__(RLController)  # the rule reads the config only
    controller.cfg = small_config(*overrides)
    assert controller._old_logp_rows_from_update(16) == rows


def test_a_late_engine_joins_at_a_sync_and_samples_from_the_actors_weights(ray_cluster,
                                                                              tmp_path):
    """rollout.startup_engines=1 of 2: start-up waits for engine 0 only; engine 1 starts once
    the run is up and joins at a sync (group re-formed, plan rebuilt for two engines, the
    actor's weights sent). After a step trained on engine 0 alone, half of the next batch
    comes from engine 1: had it missed the sync it would sample from the starting weights,
    and the bypass mismatch check (the first mini-batch's forward vs the engines' log-probs)
    would show the step's update."""
    from mcore_rl.rl.controller import RLController
    from mcore_rl.run.lifecycle import build_demo_model

    cfg = small_config("actor.tp=1", "actor.dp=2", "rollout.engines=2",
                       "rollout.startup_engines=1", "rollout.cpus_per_engine=0",
                       "algorithm.rollout_correction.mode=bypass", "train.optimizer.lr=0.01",
                       *GRPO)
    model_dir = build_demo_model(cfg, tmp_path)
    controller = RLController(cfg, model_dir, tmp_path)
    try:
        # admission happens only at a sync: engine 1 is started, not in the run
        assert controller.engines.num_engines == 1 and controller.engines.late_pending == 1
        assert controller.weight_sync.plan.num_dst == 1
        controller.reset_optimizer()
        first = controller.rl_step(1)  # engine 0 alone (the engines hold model_dir's weights)
        joined = controller.admit_late_engines(wait=True)  # the bench's steady state
        sync = controller.sync_weights()
        second = controller.rl_step(2)
        num_dst, late = controller.weight_sync.plan.num_dst, controller.engines.late_pending
    finally:
        controller.shutdown()
    assert first["rollout_engines"] == 1 and first["grad_norm"] > 0
    assert joined in ([], [1])  # [] when it was up in time to join at step 1's own sync
    assert second["rollout_engines"] == 2 and num_dst == 2 and late == 0
    assert sync["sync_bytes"] > 0
    assert second["rollout_logprob_max_diff"] < 1e-4, second["rollout_logprob_max_diff"]
