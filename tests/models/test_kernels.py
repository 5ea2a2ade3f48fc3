"""megatron's fusion switches as the run plan sets them (S3): `fused_kernels` turns on exactly
the two TransformerEngine kernels, never a fusion megatron compiles with torch.compile; those
(SwiGLU, bias-dropout-add) run only with `train.compile`, and then give the unfused numbers."""

import pytest

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.gpt import kernel_fields, te_importable, transformer_config_from_spec
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig


def test_fused_kernels_turn_on_the_te_kernels_only():
    off, on = kernel_fields(False), kernel_fields(True)
    assert not any(off.values())
    assert {k for k, v in on.items() if v} == {"apply_rope_fusion",
                                                "gradient_accumulation_fusion"}
    # megatron wraps these in torch.compile: nothing is compiled unless asked
    assert on["bias_activation_fusion"] is False and on["bias_dropout_fusion"] is False


@pytest.mark.skipif(te_importable(), reason="checks the refusal where TE is missing (CI)")
def test_megatron_refuses_fused_rope_without_transformer_engine():
    """Why the plan turns them on only with the te layer spec: without TE megatron-core
    refuses the config outright."""
    cfg = transformer_config_from_spec(get_preset("micro"), ParallelConfig(), device="cpu")
    assert cfg.apply_rope_fusion is False and cfg.gradient_accumulation_fusion is False
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        transformer_config_from_spec(get_preset("micro"), ParallelConfig(), device="cpu",
                                     fused_kernels=True)


def test_compile_turns_on_the_compiled_fusions_only():
    assert {k for k, v in kernel_fields(False, True).items() if v} == {
        "bias_activation_fusion", "bias_dropout_fusion"}
    assert {k for k, v in kernel_fields(True, True).items() if v} == {
        "apply_rope_fusion", "gradient_accumulation_fusion", "bias_activation_fusion",
        "bias_dropout_fusion"}


def _step_with_and_without_compile(rank: int, world: int) -> dict:
    import torch
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    from mcore_rl.megatron.config import TrainConfig
    from mcore_rl.megatron.train import setup_trainer, token_logprobs
    from mcore_rl.models.presets import get_preset
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import init_training_groups

    spec = get_preset("micro")
    groups = init_training_groups(ParallelConfig())
    tokens = torch.randint(0, spec.vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    compiled = {"swiglu": fused_bias_swiglu.swiglu,
                "bias_dropout_add": fused_bias_dropout.bias_dropout_add_fused_train}
    out = {}
    for compile_ in (False, True):
        trainer = setup_trainer(spec, groups, TrainConfig(compile=compile_), seed=7)
        (model,) = trainer.model
        model.train()
        logits = model(tokens[:, :-1], positions, None)
        loss = -token_logprobs(logits, tokens[:, 1:], spec.vocab, 0).mean()
        loss.backward()
        out[compile_] = {"loss": float(loss),
                         "grads": {n: p.main_grad.clone() for n, p in model.named_parameters()},
                         "compiled": {k: f.compiled for k, f in compiled.items()},
                         "config": (trainer.config.bias_activation_fusion,
                                    trainer.config.bias_dropout_fusion)}
    grads = out[False].pop("grads"), out[True].pop("grads")
    out["max_grad_diff"] = max(float((grads[1][k] - grads[0][k]).abs().max()) for k in grads[0])
    return out


def test_compiled_fusions_run_only_when_asked_and_match_the_unfused_step():
    # fresh process: whether megatron's deferred functions were ever compiled is process
    # state, and compiling leaves dynamo's caches and inductor's workers in the process
    (out,) = run_on_ranks(_step_with_and_without_compile, 1, timeout_s=300,
                          fresh_processes=True)
    # unasked: megatron's compiled functions never ran (so nothing was compiled)
    assert out[False]["config"] == (False, False)
    assert out[False]["compiled"] == {"swiglu": False, "bias_dropout_add": False}
    assert out[True]["config"] == (True, True)
    assert out[True]["compiled"] == {"swiglu": True, "bias_dropout_add": True}
    assert out[True]["loss"] == pytest.approx(out[False]["loss"], rel=1e-6)
    assert out["max_grad_diff"] < 1e-6
