"""A Megatron MoE actor (Qwen3-MoE, EP2) through RL steps, on one controller for the module.

The sync: after one step (its updates, then the sync), vLLM (CPU, TP2, fused MoE experts
re-installed and re-packed by `rollout.moe_install`) samples with the log-probs HF computes on
the actor's weights (rebuilt from the actor's shards with the layout tables).

Routing replay. `old`: the π_old pass records every token's experts, both update mini-batches
replay them, and the step reports how many of the update's own choices differed (none before
the first optimizer step, some after it) and that every choice was replayed. `rollout`: the
samples' routing (the CPU twin of the engines') is placed on the batch and replayed in the
π_old pass and the updates.

The first two tests share the run's first step (`MoeRun.first_step`, taken by whichever runs
first); the last one trains the actor without a sync, so it runs last."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.config import load_config
from mcore_rl.runconfig import RLConfig
from tests.support import DEMO_SIZED
from tests.support.moe_routing import hf_routing
from tests.support.ray_cluster import leaves_nothing
from tests.support.rl_runs import actor_shards, heldout_samples

from .test_sync_integration import BASE


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
# the actor EP2 over DP2 (two mini-batches, π_old from its own pass: routing replay `old`),
# one vLLM engine TP2
GRID = ["actor.tp=1", "actor.dp=2", "actor.ep=2", "updates_per_batch=2",
        "train.micro_batch_size=4", "algorithm.old_logprob_from_update=false",
        "algorithm.routing_replay=old", "rollout.tp=2"]


class MoeRun:
    """The module's controller (reset and synced), its model folder, and the routing each
    `_update_actor` call replayed."""

    def __init__(self, controller, model_dir):
        self.controller, self.model_dir, self.replayed = controller, model_dir, []
        self._first = None
        update = controller._update_actor

        def recorded_update(batch, old_logp, adv, extra, is_weights, routing, timer):
            self.replayed.append(routing)
            return update(batch, old_logp, adv, extra, is_weights, routing, timer)

        controller._update_actor = recorded_update

    def first_step(self) -> tuple[dict, list]:
        """RL step 1 (updates, then the sync), taken once: its metrics and the routing its
        `_update_actor` calls replayed."""
        if self._first is None:
            before = len(self.replayed)
            step = self.controller.rl_step(1)
            self._first = step, self.replayed[before:]
        return self._first


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    """One controller for the module's tests (its actor ranks record and replay; its engines,
    on CPU, return no routing)."""
    from mcore_rl.run.lifecycle import RLRun, build_demo_model

    tmp = tmp_path_factory.mktemp("moe_run")
    cfg = load_config(RLConfig, DEMO_SIZED, BASE + MOE + GRID)
    model_dir = build_demo_model(cfg, tmp)
    with leaves_nothing(ray_session, "test_moe_sync_integration's controller"):
        with RLRun(cfg, tmp, model_dir=model_dir) as rl_run:
            rl_run.begin()
            yield MoeRun(rl_run.controller, model_dir)


def test_megatron_ep2_to_vllm_matches_hf(run, ray_cluster, tmp_path):
    from mcore_rl.layouts import assemble_hf, megatron_shards
    from mcore_rl.models.hf_reference import load_hf_model, token_logprobs

    controller, model_dir = run.controller, run.model_dir
    step, _ = run.first_step()
    samples = heldout_samples(controller)
    prompts, sampled = samples["prompts"], samples["sampled"]
    assert step["grad_norm"] > 0  # the actor updated, then synced
    hf_state = assemble_hf(megatron_shards(controller.spec, controller.cfg.actor),
                           actor_shards(controller))
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


def test_old_routing_is_recorded_and_replayed_in_every_update(run, ray_cluster):
    step, replayed = run.first_step()
    (routing,) = replayed
    assert step["routing/replayed_frac"] == 1.0
    # mini-batch 1 runs on the π_old weights (no flip), mini-batch 2 after a step (lr 0.05)
    assert 0 < step["routing/flip_frac"] < 0.5, step["routing/flip_frac"]
    rows, seq = 16, routing.shape[1]
    assert tuple(routing.shape) == (rows, seq, 2, 2)  # [rows, s, layers, top-k]
    assert ((routing >= 0) & (routing < 4)).all()


def test_rollout_routing_twin_is_replayed_in_the_old_and_update_passes(run, ray_cluster,
                                                                      tmp_path):
    """R3's CPU twin: every sample carries the routing the engines would return with it
    (`Completion.routing`: each position but the last, here from an HF forward of the engines'
    weights with their routers moved, as if inference numerics chose other experts); the step's
    batch places it on the token positions; the actor's π_old pass replays it — its log-probs
    are HF's with those experts forced — and so do both update mini-batches, on every position
    that has a row (the rest, the last token and the padding, route themselves). The run's
    engines return no routing (vLLM's capture needs a GPU), so the controller is switched to
    `rollout` after its start. Runs last: its updates are not synced."""
    from dataclasses import replace

    from mcore_rl.launch.timing import PhaseTimer
    from mcore_rl.layouts import assemble_hf, megatron_shards

    from tests.megatron.test_routing_replay import _forced_router

    controller, model_dir = run.controller, run.model_dir
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
