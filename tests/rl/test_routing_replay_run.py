"""Routing replay through an RL step on a Qwen3-MoE actor (EP2). `old`: the π_old pass records
every token's experts, both update mini-batches replay them, and the step reports how many of
the update's own choices differed (none before the first optimizer step, some after it) and
that every choice was replayed. `rollout`: the samples' routing (the CPU twin of the engines')
is placed on the batch and replayed in the π_old pass and the updates."""

import pytest

from mcore_rl.config import load_config
from mcore_rl.run.config import RLConfig
from tests.support import DEMO_SIZED
from tests.support.moe_routing import hf_routing

from .test_moe_sync_integration import MOE
from .test_sync_integration import BASE


GRID = ["actor.tp=1", "actor.dp=2", "actor.ep=2", "updates_per_batch=2",
        "train.micro_batch_size=4", "algorithm.old_logprob_from_update=false",
        "algorithm.routing_replay=old"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One controller for both tests (its actor ranks record and replay; its engines, on CPU,
    return no routing). Yields (controller, model folder, the routing the updates replayed)."""
    from mcore_rl.rl.controller import RLController
    from mcore_rl.run.train import build_demo_model

    tmp = tmp_path_factory.mktemp("routing_run")
    cfg = load_config(RLConfig, DEMO_SIZED, BASE + MOE + GRID)
    model_dir = build_demo_model(cfg, tmp)
    controller = RLController(cfg, model_dir, tmp)
    replayed = []
    update = controller._update_actor

    def recorded_update(batch, old_logp, adv, extra, is_weights, routing, timer):
        replayed.append(routing)
        return update(batch, old_logp, adv, extra, is_weights, routing, timer)

    controller._update_actor = recorded_update
    try:
        controller.reset_optimizer()
        controller.sync_weights()
        yield controller, model_dir, replayed
    finally:
        controller.shutdown()


def test_old_routing_is_recorded_and_replayed_in_every_update(run):
    controller, _, replayed = run
    step = controller.rl_step(1)
    (routing,) = replayed
    assert step["routing/replayed_frac"] == 1.0
    # mini-batch 1 runs on the π_old weights (no flip), mini-batch 2 after a step (lr 0.05)
    assert 0 < step["routing/flip_frac"] < 0.5, step["routing/flip_frac"]
    rows, seq = 16, routing.shape[1]
    assert tuple(routing.shape) == (rows, seq, 2, 2)  # [rows, s, layers, top-k]
    assert ((routing >= 0) & (routing < 4)).all()


def test_rollout_routing_twin_is_replayed_in_the_old_and_update_passes(run, tmp_path):
    """R3's CPU twin: every sample carries the routing the engines would return with it
    (`Completion.routing`: each position but the last, here from an HF forward of the engines'
    weights with their routers moved, as if inference numerics chose other experts); the step's
    batch places it on the token positions; the actor's π_old pass replays it — its log-probs
    are HF's with those experts forced — and so do both update mini-batches, on every position
    that has a row (the rest, the last token and the padding, route themselves). The run's
    engines return no routing (vLLM's capture needs a GPU), so the controller is switched to
    `rollout` after its start."""
    from dataclasses import replace

    import torch

    from mcore_rl.launch.timing import PhaseTimer
    from mcore_rl.layouts import assemble_hf, megatron_shards

    from .test_moe_sync_integration import hf_model_from_state
    from tests.megatron.test_routing_replay import _forced_router

    controller, model_dir, _ = run
    cfg = controller.cfg
    controller.cfg = replace(cfg, algorithm=replace(cfg.algorithm, routing_replay="rollout"))
    try:
        timer = PhaseTimer()
        rollouts, _ = controller._rollouts_for(2, timer)
        state = assemble_hf(megatron_shards(controller.spec, cfg.actor),
                            dict(enumerate(controller.actor_weights())))
        gen = torch.Generator().manual_seed(9)
        moved = {k: v + 0.5 * torch.randn(v.shape, generator=gen)
                 if k.endswith("mlp.gate.weight") else v for k, v in state.items()}
        engines_view = hf_model_from_state(model_dir, moved, tmp_path / "moved")
        rollouts.completions = [
            [replace(c, routing=hf_routing(engines_view, p + list(c.token_ids))[:-1])
             for c in group] for p, group in zip(rollouts.prompt_ids, rollouts.completions)]
        batch, completions, _ = controller._train_batch(rollouts)
        old_logp, _, _, routing = controller._old_policy(batch, completions, 2, timer)
        free = controller.actors.per_token("logprobs", batch, "old_logprob")
        adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2))
        updates = controller._update_actor(batch, old_logp, adv * batch.mask, {}, None,
                                           routing, timer)
    finally:
        controller.cfg = cfg
    assert routing is batch.routing and routing.dtype == torch.int16
    lengths = [len(p) + len(c.token_ids) for p, group in zip(rollouts.prompt_ids,
                                                             rollouts.completions) for c in group]
    for row, length in enumerate(lengths):  # rows on positions 0 .. length - 2, -1 after
        assert (routing[row, :length - 1] >= 0).all() and (routing[row, length - 1:] == -1).all()
    model = hf_model_from_state(model_dir, state, tmp_path / "actor")
    for index, layer in enumerate(model.model.layers):
        layer.mlp.gate.forward = _forced_router(layer.mlp.gate, routing[:, :, index].numpy())
    valid = batch.mask > 0
    with torch.no_grad():
        logits = model(batch.tokens).logits.log_softmax(-1)
    forced = logits.gather(-1, batch.labels[..., None])[..., 0]
    assert (old_logp - forced).abs()[valid].max() < 1e-4
    assert (old_logp - free).abs()[valid].max() > 1e-3  # the moved routing mattered
    half = routing.shape[0] // 2  # the positions with a row, of each mini-batch's
    given = [float((r[..., 0, 0] >= 0).double().mean()) for r in (routing[:half], routing[half:])]
    assert [u["routing/replayed_frac"] for u in updates] == pytest.approx(given, abs=1e-9)
    # the update's own routers disagree with the rollout's moved routing on some tokens
    assert all(0 < u["routing/flip_frac"] < 1 for u in updates), updates
