"""Qwen3 (q/k norms, head_dim != hidden / heads), Qwen3-MoE and Mixtral built by megatron-core
from a ModelSpec compute HF transformers' logits on the same weights, on training grids with
tensor, pipeline, expert and expert-tensor parallelism and both token dispatchers.

HF weights go in through mcore_rl.layouts (so q/k-norm rows, per-expert rows over EP, and
expert-TP splits of each expert's [gate; up] are exercised). One spawned 2-rank launch runs
every row; the HF reference loads the same tensors from a saved checkpoint folder (transformers
5 fuses experts in memory; the folder holds the released per-expert names).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_weights import random_hf_weights
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.models.presets import get_preset
from mcore_rl.models.spec import ModelSpec

MICRO = get_preset("micro")  # hidden 128, 4 heads / 2 kv heads, 4 layers, vocab 250
QWEN3 = MICRO.with_(family="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=48,
                    rope_theta=1e6, norm_eps=1e-6)
QWEN3_MOE = QWEN3.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", head_dim=32,
                        num_experts=4, moe_ffn=64, experts_per_token=2, norm_topk_prob=False)
MIXTRAL = MICRO.with_(family="mixtral", architecture="MixtralForCausalLM", ffn=96,
                      num_experts=4, moe_ffn=96, experts_per_token=2)

# id: (spec, ParallelConfig kwargs, token dispatcher) — every grid on 2 ranks.
CASES = {
    "qwen3_tp2": (QWEN3, dict(tp=2), None),                   # q/k norms per head, head_dim 48
    "qwen3_pp2": (QWEN3, dict(pp=2), None),                   # ... over two stages
    # softmax over all experts at the top k (norm_topk_prob=false → moe_router_pre_softmax)
    "qwen3_moe_ep2_alltoall": (QWEN3_MOE, dict(dp=2, ep=2), "alltoall"),
    # renormalized top-k, attention TP2 with experts split 2 ways by EP (etp=1)
    "qwen3_moe_norm_tp2ep2": (QWEN3_MOE.with_(norm_topk_prob=True),
                              dict(tp=2, ep=2, etp=1), "allgather"),
    "mixtral_tp2_etp2": (MIXTRAL, dict(tp=2), "allgather"),   # expert-TP: each expert split 2
    "mixtral_pp2_ep2": (MIXTRAL, dict(pp=2, ep=1), "alltoall"),
}
TOKENS = torch.randint(0, MICRO.vocab, (2, 24), generator=torch.Generator().manual_seed(3))


def _hf_reference(spec: ModelSpec, weights: dict[str, torch.Tensor], tmp) -> np.ndarray:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from mcore_rl.models.hf_factory import hf_config_from_spec

    hf_config_from_spec(spec).save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits.numpy()


def _megatron_logits(rank, world, cases):
    """Per case: the full logits [2, 24, vocab] from the last stage (None elsewhere)."""
    from mcore_rl.layouts import materialize_rank, megatron_shards
    from mcore_rl.models.gpt import (MoEOptions, build_gpt_model, load_chunks,
                                     transformer_config_from_spec)
    from mcore_rl.parallel.config import ParallelConfig
    from mcore_rl.parallel.groups import init_training_groups
    from mcore_rl.megatron.train import MicroBatch, forward_logits

    out = {}
    for name, (spec, parallel_kw, dispatcher, weights) in cases.items():
        parallel = ParallelConfig(**parallel_kw)
        groups = init_training_groups(parallel)
        config = transformer_config_from_spec(
            spec, parallel, moe=MoEOptions(dispatcher=dispatcher or "allgather"),
            device=groups.device)
        chunks = build_gpt_model(spec, parallel, groups, config=config)
        shards = materialize_rank(megatron_shards(spec, parallel), rank,
                                  lambda n: torch.from_numpy(weights[n]))
        load_chunks(chunks, shards, parallel.vpp)
        for chunk in chunks:
            chunk.eval()
        batch = MicroBatch(tokens=TOKENS, labels=TOKENS, loss_mask=torch.ones(TOKENS.shape))
        logits = forward_logits(chunks, [batch], vocab=spec.vocab, groups=groups)
        out[name] = None if logits is None else logits[0].numpy()
    return out


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    weights = {name: random_hf_weights(spec, seed=i)
               for i, (name, (spec, _, _)) in enumerate(CASES.items())}
    cases = {name: (spec, kw, disp, {k: v.numpy() for k, v in weights[name].items()})
             for name, (spec, kw, disp) in CASES.items()}
    megatron = run_on_ranks(_megatron_logits, 2, cases, timeout_s=300)
    return {name: (_hf_reference(spec, weights[name], tmp_path_factory.mktemp(name)),
                   [r[name] for r in megatron if r[name] is not None])
            for name, (spec, _, _) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(compared, case):
    hf, ranks = compared[case]
    assert ranks, "no rank returned logits"
    for logits in ranks:
        assert logits.shape == hf.shape
        np.testing.assert_allclose(logits, hf, rtol=0, atol=1e-4)
