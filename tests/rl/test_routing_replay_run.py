"""`algorithm.routing_replay: old` through a whole RL step on a Qwen3-MoE actor (EP2): the
π_old pass records every token's experts, both update mini-batches replay them, and the step
reports how many of the update's own choices differed (none before the first optimizer step,
some after it) and that every choice was replayed."""

from mcore_rl.config import load_config
from mcore_rl.run.config import RLConfig
from tests.support import DEMO_SIZED

from .test_moe_sync_integration import MOE
from .test_sync_integration import BASE


def run_step(tmp_path, overrides):
    from mcore_rl.rl.controller import RLController
    from mcore_rl.run.train import build_demo_model

    cfg = load_config(RLConfig, DEMO_SIZED, BASE + MOE + overrides)
    controller = RLController(cfg, build_demo_model(cfg, tmp_path), tmp_path)
    try:
        controller.reset_optimizer()
        controller.sync_weights()
        return controller.rl_step(1), controller.routing
    finally:
        controller.shutdown()


def test_old_routing_is_recorded_and_replayed_in_every_update(tmp_path):
    grid = ["actor.tp=1", "actor.dp=2", "actor.ep=2", "updates_per_batch=2",
            "train.micro_batch_size=4", "algorithm.old_logprob_from_update=false"]
    step, routing = run_step(tmp_path, grid + ["algorithm.routing_replay=old"])
    assert step["routing/replayed_frac"] == 1.0
    # mini-batch 1 runs on the π_old weights (no flip), mini-batch 2 after a step (lr 0.05)
    assert 0 < step["routing/flip_frac"] < 0.5, step["routing/flip_frac"]
    rows, seq = 16, routing.shape[1]
    assert tuple(routing.shape) == (rows, seq, 2, 2)  # [rows, s, layers, top-k]
    assert ((routing >= 0) & (routing < 4)).all()


def hf_routing(model, tokens):
    """Every token's experts per layer as `model` (HF Qwen3-MoE) routes them: [n, s, L, k]."""
    import torch

    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda module, args, out: chosen.append(out[2].reshape(*tokens.shape, -1)))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(chosen, dim=2)


def test_rollout_routing_twin_is_replayed_in_the_old_and_update_passes(tmp_path):
    """R3's CPU twin: the rollout's routing comes from an HF forward of the engines' weights
    with its routers moved (as if inference numerics chose other experts); the actor's π_old
    pass replays it — its log-probs are HF's with those experts forced — and so do both
    update mini-batches."""
    import torch

    from mcore_rl.launch.timing import PhaseTimer
    from mcore_rl.layouts import assemble_hf, megatron_shards
    from mcore_rl.rl.controller import RLController
    from mcore_rl.run.train import build_demo_model

    from .test_moe_sync_integration import hf_model_from_state
    from tests.megatron.test_routing_replay import _forced_router

    cfg = load_config(RLConfig, DEMO_SIZED, BASE + MOE + [
        "actor.tp=1", "actor.dp=2", "actor.ep=2", "updates_per_batch=2",
        "train.micro_batch_size=4", "algorithm.routing_replay=rollout",
        "algorithm.rollout_correction.mode=none"])
    model_dir = build_demo_model(cfg, tmp_path)
    controller = RLController(cfg, model_dir, tmp_path)
    twin = {}

    def rollout_routing(batch, completions):  # the engines hold the actor's synced weights
        state = assemble_hf(megatron_shards(controller.spec, cfg.actor),
                            dict(enumerate(controller.actor_weights())))
        gen = torch.Generator().manual_seed(9)
        moved = {k: v + 0.5 * torch.randn(v.shape, generator=gen)
                 if k.endswith("mlp.gate.weight") else v for k, v in state.items()}
        twin["routing"] = hf_routing(hf_model_from_state(model_dir, moved, tmp_path / "moved"),
                                     batch.tokens)
        twin["actor"] = hf_model_from_state(model_dir, state, tmp_path / "actor")
        return twin["routing"]

    controller.rollout_routing = rollout_routing
    try:
        controller.reset_optimizer()
        controller.sync_weights()
        timer = PhaseTimer()
        rollouts, _ = controller._rollouts_for(1, timer)
        batch, completions, _ = controller._train_batch(rollouts)
        old_logp, _, _ = controller._old_policy(batch, completions, 1, timer)
        free = controller.actors.per_token("logprobs", batch, "old_logprob")
        adv = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2))
        updates = controller._update_actor(batch, old_logp, adv * batch.mask, {}, None, timer)
    finally:
        controller.shutdown()
    model = twin["actor"]
    for index, layer in enumerate(model.model.layers):
        layer.mlp.gate.forward = _forced_router(layer.mlp.gate,
                                                twin["routing"][:, :, index].numpy())
    # HF with the rollout's experts forced, row by row (its router hook takes [n·s] tokens)
    valid = batch.mask > 0
    with torch.no_grad():
        logits = model(batch.tokens).logits.log_softmax(-1)
    forced = logits.gather(-1, batch.labels[..., None])[..., 0]
    assert (old_logp - forced).abs()[valid].max() < 1e-4
    assert (old_logp - free).abs()[valid].max() > 1e-3  # the moved routing mattered
    assert all(u["routing/replayed_frac"] == 1.0 for u in updates)
    # the update's own routers disagree with the rollout's moved routing on some tokens
    assert all(0 < u["routing/flip_frac"] < 1 for u in updates), updates
