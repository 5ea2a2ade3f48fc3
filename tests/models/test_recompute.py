"""TrainConfig.recompute reaches megatron: with selective / full recomputation a TP2 forward +
backward of the micro Llama gives the same loss and gradients as without, and the recomputed
modules really run twice (once forward, once again in backward)."""

from __future__ import annotations

import pytest

from mcore_rl.launch.spawn import run_on_ranks

MODES = ("none", "selective", "full")


def _step(rank: int, world: int) -> dict:
    import torch

    from mcore_rl.models.gpt import build_gpt_model, transformer_config_from_spec
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import Axis, init_training_groups
    from mcore_rl.megatron.train import token_logprobs

    spec, parallel = get_preset("micro"), ParallelConfig(tp=2)
    groups = init_training_groups(parallel)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (2, 17), generator=gen)
    positions = torch.arange(16).expand(2, 16)
    out = {}
    for mode in MODES:
        config = transformer_config_from_spec(spec, parallel, recompute=mode,
                                              device=groups.device)
        (model,) = build_gpt_model(spec, parallel, groups, seed=7, config=config)
        model.train()
        calls = {"attn": 0, "layer": 0}
        layer = model.decoder.layers[0]
        for key, module in (("layer", layer), ("attn", layer.self_attention.core_attention)):
            module.register_forward_pre_hook(
                lambda *_, key=key, calls=calls: calls.__setitem__(key, calls[key] + 1))
        logits = model(tokens[:, :-1], positions, None)
        logp = token_logprobs(logits, tokens[:, 1:], spec.vocab, groups.rank_in(Axis.TP))
        loss = -logp.mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[mode] = {"loss": float(loss), "calls": dict(calls),
                     "sq_norm": sum(float(g.float().pow(2).sum()) for g in grads.values()),
                     "grads": grads}
    # the trainer builds its model config from TrainConfig.recompute
    from mcore_rl.megatron.config import TrainConfig
    from mcore_rl.megatron.train import setup_trainer

    out["trainer_granularity"] = {
        mode: setup_trainer(spec, groups, TrainConfig(recompute=mode)).config.recompute_granularity
        for mode in MODES}
    base = out["none"]["grads"]
    for mode in MODES:
        grads = out[mode].pop("grads")
        assert sorted(grads) == sorted(base), mode
        out[mode]["max_grad_diff"] = max(float((grads[k] - base[k]).abs().max()) for k in base)
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_step, 2, timeout_s=240)


def test_recompute_same_loss_and_grads(results):
    for rank_out in results:
        base = rank_out["none"]
        assert base["calls"] == {"attn": 1, "layer": 1}  # no recompute: one forward each
        for mode in ("selective", "full"):
            assert rank_out[mode]["loss"] == pytest.approx(base["loss"], rel=1e-6)
            assert rank_out[mode]["sq_norm"] == pytest.approx(base["sq_norm"], rel=1e-5)
            assert rank_out[mode]["max_grad_diff"] < 1e-6
        # selective recomputes core attention only; full recomputes whole layers
        assert results[0]["selective"]["calls"] == {"attn": 2, "layer": 1}
        assert results[0]["full"]["calls"] == {"attn": 2, "layer": 2}
        assert rank_out["trainer_granularity"] == {"none": None, "selective": "selective",
                                                   "full": "full"}


def test_bad_recompute_value():
    from mcore_rl.models.gpt import transformer_config_from_spec
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel.config import ParallelConfig

    with pytest.raises(ValueError, match="recompute='some'"):
        transformer_config_from_spec(get_preset("micro"), ParallelConfig(), recompute="some",
                                     device="cpu")
