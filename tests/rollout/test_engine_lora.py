"""One in-process vLLM engine serving the policy's LoRA adapter (`actor.lora.sync: adapter`):
adapters installed from memory give HF + PEFT's log-probs, a new adapter replaces the old, the
base weights still install into the LoRA-wrapped model, and bad adapters are refused."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.models.hf_reference import load_hf_model, token_logprobs
from mcore_rl.rollout import RolloutConfig, RolloutEngine, RolloutError, SamplingConfig
from mcore_rl.rollout.lora import EngineLoRA, unsupported_lora_reason

from .helpers import MAX_MODEL_LEN, hf_model_with, hf_state, perturbed, prompts, rank_items

LORA = EngineLoRA(rank=4, alpha=8.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAMPLE = SamplingConfig(max_tokens=8, n=2, seed=3)


@pytest.fixture(scope="module")
def engine(micro_dir):
    eng = RolloutEngine(micro_dir, RolloutConfig(max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25),
                        call_timeout_s=600.0, lora=LORA)
    yield eng
    eng.shutdown()


def peft_model(base, seed: int):
    """`base` with a PEFT LoRA adapter of LORA's rank and scale, B random (not PEFT's zeros,
    so the adapter changes the logits)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base, LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha,
                                            target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """PEFT names as the trainer sends them: `model.layers.0.self_attn.q_proj.lora_A.weight`."""
    from peft import get_peft_model_state_dict

    return {k.removeprefix("base_model.model."): v.detach().clone()
            for k, v in get_peft_model_state_dict(model).items()}


def worst_gap(engine, reference) -> float:
    """Max |vLLM − reference| over the log-probs of sampled tokens."""
    ps, worst = prompts(3, 6, seed=4), 0.0
    with torch.no_grad():
        for p, samples in zip(ps, engine.generate(ps, SAMPLE)):
            for c in samples:
                want = token_logprobs(reference, [p + list(c.token_ids)])[0][len(p) - 1:]
                worst = max(worst, float((torch.tensor(c.logprobs) - want).abs().max()))
    return worst


def test_adapters_from_memory_give_peft_logprobs_and_replace_each_other(engine, micro_dir):
    base = load_hf_model(micro_dir)
    assert worst_gap(engine, base) < 1e-4  # no adapter yet: the base generates
    first = peft_model(load_hf_model(micro_dir), seed=1)
    names = engine.install_tensors(adapter_tensors(first).items(), adapter=True)
    assert len(names) == 2 * len(TARGETS) * 4 and engine.adapter_installed
    assert worst_gap(engine, first) < 1e-4
    assert worst_gap(engine, base) > 1e-2  # really adapted
    second = peft_model(load_hf_model(micro_dir), seed=2)
    engine.install_tensors(adapter_tensors(second).items(), adapter=True)
    assert worst_gap(engine, second) < 1e-4
    assert worst_gap(engine, first) > 1e-2  # the first adapter is gone


def test_base_weights_install_under_the_adapter(engine, micro_dir):
    """vLLM wraps adapted linears (`base_layer`); shapes and installs keep the plain names."""
    shapes = engine.describe_shards()[0]
    assert not [n for n in shapes if "base_layer" in n or "lora" in n]
    state = perturbed(hf_state(micro_dir), seed=5)
    engine.install_tensors(rank_items(state, 1, 0))
    adapted = peft_model(hf_model_with(micro_dir, state), seed=6)
    engine.install_tensors(adapter_tensors(adapted).items(), adapter=True)
    assert worst_gap(engine, adapted) < 1e-4
    engine.install_tensors(rank_items(hf_state(micro_dir), 1, 0))  # back to the base


def test_bad_adapters_are_refused_in_one_line(engine, micro_dir):
    good = adapter_tensors(peft_model(load_hf_model(micro_dir), seed=7))
    bad = {"model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(LORA.rank, 128)}
    with pytest.raises(RolloutError, match="adapts none of its rotary modules"):
        engine.install_tensors({**good, **bad}.items(), adapter=True)
    too_big = {k: torch.zeros(32, v.shape[1]) if ".lora_A." in k else v
               for k, v in good.items()}
    with pytest.raises(RolloutError, match=r"lora_A.weight: shape \(32, 128\), not of the "
                                            "adapter's rank 4"):
        engine.install_tensors(too_big.items(), adapter=True)
    engine.install_tensors(good.items(), adapter=True)  # a refused adapter broke nothing


def test_engine_lora_settings_and_architectures():
    assert EngineLoRA(16, 32.0).max_lora_rank == 16
    assert EngineLoRA(9, 32.0).max_lora_rank == 16
    assert EngineLoRA(4, 8.0).llm_kwargs()["max_loras"] == 1
    with pytest.raises(ValueError, match="up to 512"):
        EngineLoRA(600, 32.0).max_lora_rank
    assert unsupported_lora_reason("LlamaForCausalLM") is None
    assert "does not know" in unsupported_lora_reason("NoSuchForCausalLM")
