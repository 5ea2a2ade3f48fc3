"""megatron's fusion switches as the run plan asks for them and as the process that builds the
model turns them on (S3, N1): `fused_kernels` asks for exactly the TransformerEngine RoPE kernel
and apex's weight-grad accumulation, never a fusion megatron compiles with torch.compile; those
(SwiGLU, bias-dropout-add) run only with `train.compile`, and then give the unfused numbers.
Each is on only where its provider imports (`models.kernels`), so a process without one builds
without it — where megatron-core itself refuses or raises."""

import importlib.util

import pytest

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.gpt import kernel_fields, transformer_config_from_spec
from mcore_rl.models.kernels import (KERNELS, dropped, dropped_on_ranks, kernel_switches,
                                     resolve_kernels, wanted_kernels)
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig

SWITCHES = {"apply_rope_fusion", "gradient_accumulation_fusion", "bias_activation_fusion",
            "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm",
            "cross_entropy_loss_fusion"}
ALL_THERE = {"te_rope": None, "apex_wgrad": None, "torch_compile": None}
NO_APEX = {**ALL_THERE, "apex_wgrad": "apex's fused_weight_gradient_mlp_cuda is not installed"}


def test_fused_kernels_ask_for_the_te_and_apex_kernels_only():
    off, on = wanted_kernels(False), wanted_kernels(True)
    assert set(off) == set(on) == SWITCHES == {k.field for k in KERNELS}
    assert not any(off.values())
    assert {k for k, v in on.items() if v} == {"apply_rope_fusion",
                                                "gradient_accumulation_fusion"}
    # megatron wraps these in torch.compile: nothing is compiled unless asked
    assert on["bias_activation_fusion"] is False and on["bias_dropout_fusion"] is False


def test_compile_asks_for_the_compiled_fusions_only():
    assert {k for k, v in wanted_kernels(False, True).items() if v} == {
        "bias_activation_fusion", "bias_dropout_fusion"}
    assert {k for k, v in wanted_kernels(True, True).items() if v} == {
        "apply_rope_fusion", "gradient_accumulation_fusion", "bias_activation_fusion",
        "bias_dropout_fusion"}


def test_each_kernel_is_on_only_where_its_provider_imports():
    """A node with TransformerEngine but without apex (a plain `pip install .[gpu]`): fused
    RoPE on, the weight-grad accumulation off, saying which module is missing and what that
    costs; with every provider both are on; unasked kernels stay off whatever is there."""
    decisions = resolve_kernels(True, False, device="cuda", missing=NO_APEX)
    switches = kernel_switches(decisions)
    assert set(switches) == SWITCHES
    assert {k for k, v in switches.items() if v} == {"apply_rope_fusion"}
    (lost,) = dropped(decisions)
    assert lost.field == "gradient_accumulation_fusion" and lost.wanted and not lost.on
    assert lost.reason.startswith("off: apex's fused_weight_gradient_mlp_cuda is not installed;"
                                  " without it every linear")
    every = kernel_switches(resolve_kernels(True, True, device="cuda", missing=ALL_THERE))
    assert {k for k, v in every.items() if v} == {"apply_rope_fusion",
                                                  "gradient_accumulation_fusion",
                                                  "bias_activation_fusion", "bias_dropout_fusion"}
    unasked = resolve_kernels(False, False, device="cuda", missing=ALL_THERE)
    assert not any(kernel_switches(unasked).values()) and not dropped(unasked)
    # what the controller prints from the ranks' reports: one line per lost kernel
    as_reported = [[d.as_dict() for d in decisions]] * 2
    assert dropped_on_ranks(as_reported) == [
        f"gradient_accumulation_fusion {lost.reason} (actor ranks 0, 1 of 2)"]


@pytest.mark.parametrize("module,field", [("transformer_engine", "apply_rope_fusion"),
                                          ("fused_weight_gradient_mlp_cuda",
                                           "gradient_accumulation_fusion")])
def test_this_process_turns_a_kernel_on_exactly_when_its_provider_imports(module, field):
    here = importlib.util.find_spec(module) is not None
    (d,) = [d for d in resolve_kernels(True, device="cuda") if d.field == field]
    assert (d.wanted, d.on) == (True, here)
    assert kernel_fields(True, device="cuda")[field] is here
    if not here:
        assert module in d.reason and "without it" in d.reason


def test_megatron_refuses_fused_rope_without_te_and_the_builder_builds_without_it():
    """Why the intent is resolved where the model is built: megatron-core refuses a config
    that asks for a kernel whose provider is missing; the builder asked for the fused kernels
    turns on only those whose providers import here."""
    from megatron.core.transformer import TransformerConfig

    fused = transformer_config_from_spec(get_preset("micro"), ParallelConfig(), device="cpu",
                                         fused_kernels=True)
    for field in ("apply_rope_fusion", "gradient_accumulation_fusion"):
        here = kernel_fields(True, device="cpu")[field]
        assert getattr(fused, field) is here
    if not kernel_fields(True, device="cpu")["apply_rope_fusion"]:  # no TE here (CI)
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                              apply_rope_fusion=True)


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
