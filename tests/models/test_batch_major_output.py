"""The output layer computes its logits batch-major (`models.gpt.batch_major_output`): at TP2
the micro Llama's logits and gradients equal those of the same model with megatron's own
sequence-major layer (its hooks removed), and the [b, s, V/tp] logits GPTModel returns are the
output layer's own storage — megatron's `transpose(0, 1).contiguous()` copied nothing. With
sequence parallelism the layer is left as megatron builds it (its input is gathered on dim 0)."""

from __future__ import annotations

import torch

from mcore_rl.launch.spawn import run_on_ranks


def _logits_and_grads(rank: int, world: int) -> dict:
    from mcore_rl.megatron.train import token_logprobs
    from mcore_rl.models.gpt import build_gpt_model
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import Axis, init_training_groups

    spec, parallel = get_preset("micro"), ParallelConfig(tp=2)
    groups = init_training_groups(parallel)
    tokens = torch.randint(0, spec.vocab, (3, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(3, 16)
    out = {}
    for layout in ("batch_major", "megatron"):
        (model,) = build_gpt_model(spec, parallel, groups, seed=7)
        if layout == "megatron":
            model.output_layer._forward_pre_hooks.clear()
            model.output_layer._forward_hooks.clear()
        computed = []
        model.output_layer.register_forward_hook(lambda _m, _a, o: computed.append(o[0]))
        logits = model(tokens[:, :-1], positions, None)
        logp = token_logprobs(logits, tokens[:, 1:], spec.vocab, groups.rank_in(Axis.TP))
        (-logp.mean()).backward()
        out[layout] = {
            "logits": logits.detach().clone(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "shared": logits.untyped_storage().data_ptr()
            == computed[0].untyped_storage().data_ptr()}
    sp = ParallelConfig(tp=2, sequence_parallel=True)
    (model,) = build_gpt_model(spec, sp, init_training_groups(sp), seed=7)
    out["sp_hooks"] = len(model.output_layer._forward_pre_hooks)
    return out


def test_batch_major_logits_equal_megatrons_and_skip_its_copy():
    for out in run_on_ranks(_logits_and_grads, 2, timeout_s=240):
        mine, theirs = out["batch_major"], out["megatron"]
        torch.testing.assert_close(mine["logits"], theirs["logits"], rtol=1e-6, atol=1e-6)
        assert mine["grads"].keys() == theirs["grads"].keys()
        for name, grad in mine["grads"].items():
            torch.testing.assert_close(grad, theirs["grads"][name], rtol=1e-5, atol=1e-6,
                                       msg=name)
        assert mine["shared"] and not theirs["shared"]  # megatron's layout copies
        assert out["sp_hooks"] == 0
