"""Layout tables expanded to shard maps: HF → side → HF round trips are bit-exact, per-rank
shapes follow each side's rules, and impossible grids are refused with the reason."""

import pytest
import torch

from mcore_rl.layouts import (assemble_hf, hf_shards, materialize_rank,
                              megatron_shards, vllm_shards)
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

MICRO = get_preset("micro")
FAMILIES = {
    "llama-gqa": MICRO,
    # Mistral-style: Llama names, MHA-free GQA with 4:1 ratio, head_dim != hidden/heads.
    "mistral": MICRO.with_(architecture="MistralForCausalLM", heads=8, kv_heads=2, head_dim=32),
    "qwen2-tied-bias": MICRO.with_(family="qwen2", architecture="Qwen2ForCausalLM",
                                   qkv_bias=True, tied_embeddings=True),
    # q/k norms of size head_dim, head_dim 48 != hidden / heads
    "qwen3": MICRO.with_(family="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True,
                         head_dim=48),
}
QWEN3_MOE = MICRO.with_(family="qwen3_moe", architecture="Qwen3MoeForCausalLM", qk_norm=True,
                        num_experts=4, moe_ffn=64, experts_per_token=2)
MIXTRAL = MICRO.with_(family="mixtral", architecture="MixtralForCausalLM", num_experts=4,
                      moe_ffn=256, experts_per_token=2)
MOE = {"qwen3-moe": QWEN3_MOE, "mixtral": MIXTRAL}


def random_hf_state(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_shards(spec).hf_shapes.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("parallel", [
    ParallelConfig(),                                   # one process
    ParallelConfig(tp=2, pp=2),                         # TP and PP
    ParallelConfig(pp=2, vpp=2),                        # interleaved chunks: model{v}. keys
    ParallelConfig(pp=2, first_stage_layers=1),         # uneven stages
    ParallelConfig(tp=2, dp=2),                         # DP replicas hold identical pieces
], ids=["tp1", "tp2pp2", "pp2vpp2", "pp2uneven", "tp2dp2"])
def test_hf_megatron_hf_round_trip_is_bit_exact(family, parallel):
    spec = FAMILIES[family]
    state = random_hf_state(spec)
    smap = megatron_shards(spec, parallel)
    local = {r: materialize_rank(smap, r, state.__getitem__) for r in smap.ranks}
    back = assemble_hf(smap, local)
    assert back.keys() == state.keys()
    for name in state:
        assert torch.equal(back[name], state[name]), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_vllm_hf_round_trip_is_bit_exact(family, tp):
    spec = FAMILIES[family]
    state = random_hf_state(spec)
    smap = vllm_shards(spec, tp)
    back = assemble_hf(smap, {r: materialize_rank(smap, r, state.__getitem__)
                              for r in smap.ranks})
    assert all(torch.equal(back[n], state[n]) for n in state)


def test_megatron_qkv_interleaves_query_groups():
    # micro: 4 q heads, 2 kv heads, head_dim 32 → group g = [q_2g, q_2g+1, k_g, v_g].
    spec = MICRO
    state = random_hf_state(spec)
    local = materialize_rank(megatron_shards(spec, ParallelConfig(tp=2)), 1, state.__getitem__)
    qkv = local["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    hd = spec.head_dim
    expected = torch.cat([q[2 * hd:4 * hd], k[hd:2 * hd], v[hd:2 * hd]])  # rank 1 = group 1
    assert torch.equal(qkv, expected)


def test_megatron_fc1_holds_gate_then_up_per_rank():
    state = random_hf_state(MICRO)
    local = materialize_rank(megatron_shards(MICRO, ParallelConfig(tp=2)), 0, state.__getitem__)
    gate, up = (state[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    half = MICRO.ffn // 2
    assert torch.equal(local["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([gate[:half], up[:half]]))


def test_vllm_replicates_kv_heads_when_tp_exceeds_them():
    # 2 kv heads over TP=4: ranks 0,1 hold kv head 0; ranks 2,3 hold kv head 1.
    state = random_hf_state(MICRO)
    smap = vllm_shards(MICRO, 4)
    hd = MICRO.head_dim
    k = state["model.layers.0.self_attn.k_proj.weight"]
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        qkv = materialize_rank(smap, rank, state.__getitem__)[
            "model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape == (3 * hd, MICRO.hidden)
        assert torch.equal(qkv[hd:2 * hd], k[head * hd:(head + 1) * hd])


def test_vocab_padding_rules_and_zero_rows():
    # vocab 250: vLLM pads to 256 (multiple of 64), Megatron to a multiple of 128·tp.
    state = random_hf_state(MICRO)
    v = materialize_rank(vllm_shards(MICRO, 2), 1, state.__getitem__)["lm_head.weight"]
    assert v.shape == (128, MICRO.hidden)
    assert torch.equal(v[:122], state["lm_head.weight"][128:250]) and not v[122:].any()
    m = megatron_shards(MICRO, ParallelConfig(tp=2))
    assert m.ranks[0]["embedding.word_embeddings.weight"].shape == (128, MICRO.hidden)
    assert megatron_shards(MICRO, ParallelConfig()).ranks[0][
        "embedding.word_embeddings.weight"].shape == (256, MICRO.hidden)


def test_tied_embeddings_keep_megatron_output_copy_only_with_pp():
    tied = FAMILIES["qwen2-tied-bias"]
    one_stage = megatron_shards(tied, ParallelConfig())
    assert "output_layer.weight" not in one_stage.ranks[0]
    two_stages = megatron_shards(tied, ParallelConfig(pp=2))
    out = two_stages.ranks[1]["output_layer.weight"]
    assert {p.hf_name for p in out.pieces} == {"model.embed_tokens.weight"}
    assert "lm_head.weight" not in vllm_shards(tied, 2).ranks[0]


def test_te_spec_names_fuse_norms_into_linears():
    smap = megatron_shards(MICRO, ParallelConfig(), layer_spec="te")
    keys = smap.ranks[0]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys
    assert "decoder.layers.0.input_layernorm.weight" not in keys


def test_vpp_chunks_get_interleaved_global_layers():
    # 4 layers, pp2·vpp2: stage 0 holds layers 0 (chunk 0) and 2 (chunk 1).
    smap = megatron_shards(MICRO, ParallelConfig(pp=2, vpp=2))
    hf_of = {k: t.pieces[0].hf_name for k, t in smap.ranks[0].items()}
    assert hf_of["model0.decoder.layers.0.input_layernorm.weight"] == \
        "model.layers.0.input_layernorm.weight"
    assert hf_of["model1.decoder.layers.0.input_layernorm.weight"] == \
        "model.layers.2.input_layernorm.weight"


@pytest.mark.parametrize("make, message", [
    (lambda: megatron_shards(MICRO, ParallelConfig(tp=4)),
     "parallel.tp=4: does not divide num_key_value_heads=2"),
    (lambda: megatron_shards(MICRO, ParallelConfig(tp=3)),
     "parallel.tp=3: does not divide num_attention_heads=4"),
    (lambda: megatron_shards(MICRO, ParallelConfig(pp=3)),
     "does not divide num_layers=4"),
    (lambda: vllm_shards(MICRO, 3), "vLLM tp=3 does not divide num_attention_heads=4"),
])
def test_impossible_grids_are_refused_with_the_reason(make, message):
    with pytest.raises(Exception, match=message.replace("·", ".")):
        make()


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("parallel", [
    ParallelConfig(),                                   # one process: all experts local
    ParallelConfig(dp=2, ep=2),                         # EP2: 2 experts per rank
    ParallelConfig(tp=2, ep=2, etp=1),                  # TP2·EP2 on 2 ranks, experts whole
    ParallelConfig(tp=2, dp=2, ep=2),                   # expert-TP 2 (etp = tp) and EP2
    ParallelConfig(pp=2, vpp=2, tp=2, dp=2, ep=4, etp=1),  # VPP chunks, EP4 over TP2·DP2
], ids=["tp1", "ep2", "tp2ep2", "etp2ep2", "pp2vpp2ep4"])
def test_moe_hf_megatron_hf_round_trip_is_bit_exact(family, parallel):
    spec = MOE[family]
    state = random_hf_state(spec)
    smap = megatron_shards(spec, parallel)
    local = {r: materialize_rank(smap, r, state.__getitem__) for r in smap.ranks}
    back = assemble_hf(smap, local)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[n], state[n]) for n in state)


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_moe_hf_vllm_hf_round_trip_is_bit_exact(family, tp):
    spec = MOE[family]
    state = random_hf_state(spec)
    smap = vllm_shards(spec, tp)
    back = assemble_hf(smap, {r: materialize_rank(smap, r, state.__getitem__)
                              for r in smap.ranks})
    assert all(torch.equal(back[n], state[n]) for n in state)


def test_megatron_experts_are_local_per_ep_rank_with_gate_then_up_per_etp_rank():
    # 4 experts over EP2: rank with ep1 holds global experts 2, 3 as local 0, 1; etp=2 splits
    # each expert's [gate; up] into [gate_r; up_r].
    spec, parallel = QWEN3_MOE, ParallelConfig(tp=2, dp=2, ep=2)
    state = random_hf_state(spec)
    rank = next(r for r in range(4) if parallel.expert_coords_of(r) == {
        "etp": 1, "ep": 1, "edp": 0, "pp": 0})
    local = materialize_rank(megatron_shards(spec, parallel), rank, state.__getitem__)
    half = spec.moe_ffn // 2
    for j, expert in enumerate((2, 3)):
        e = f"model.layers.1.mlp.experts.{expert}"
        fc1 = local[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([state[f"{e}.gate_proj.weight"][half:],
                                           state[f"{e}.up_proj.weight"][half:]]))
        fc2 = local[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.weight"]
        assert torch.equal(fc2, state[f"{e}.down_proj.weight"][:, half:])
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in local
    assert torch.equal(local["decoder.layers.1.mlp.router.weight"],
                       state["model.layers.1.mlp.gate.weight"])


def test_vllm_fused_moe_stacks_every_expert_with_gate_then_up_per_tp_rank():
    # vLLM FusedMoE w13_weight [E, 2·I/tp, H], w2_weight [E, H, I/tp] (routed_experts.py).
    spec = MIXTRAL
    state = random_hf_state(spec)
    local = materialize_rank(vllm_shards(spec, 2), 1, state.__getitem__)
    w13 = local["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"]
    w2 = local["model.layers.0.block_sparse_moe.experts.routed_experts.w2_weight"]
    half = spec.moe_ffn // 2
    assert w13.shape == (4, spec.moe_ffn, spec.hidden) and w2.shape == (4, spec.hidden, half)
    for e in range(4):
        p = f"model.layers.0.block_sparse_moe.experts.{e}"
        assert torch.equal(w13[e], torch.cat([state[f"{p}.w1.weight"][half:],
                                              state[f"{p}.w3.weight"][half:]]))
        assert torch.equal(w2[e], state[f"{p}.w2.weight"][:, half:])
    assert torch.equal(local["model.layers.0.block_sparse_moe.gate.weight"],
                       state["model.layers.0.block_sparse_moe.gate.weight"])


def test_qwen3_qk_norms_are_whole_on_every_rank():
    spec = FAMILIES["qwen3"]
    for smap in (megatron_shards(spec, ParallelConfig(tp=2)), vllm_shards(spec, 4)):
        for tensors in smap.ranks.values():
            key = next(k for k in tensors if k.endswith(("q_layernorm.weight", "q_norm.weight")))
            assert tensors[key].shape == (spec.head_dim,)


@pytest.mark.parametrize("make, message", [
    (lambda: megatron_shards(QWEN3_MOE, ParallelConfig(dp=3, ep=3)),
     "parallel.ep=3: does not divide num_experts=4"),
    (lambda: megatron_shards(QWEN3_MOE, ParallelConfig(tp=2, dp=2, ep=2, etp=4)),
     "etp \\* ep = 4\\*2 must divide tp \\* dp"),
    (lambda: megatron_shards(MICRO, ParallelConfig(dp=2, ep=2)),
     "parallel.ep=2: needs a mixture-of-experts model"),
    (lambda: megatron_shards(QWEN3_MOE, ParallelConfig(tp=2, dp=3, ep=3, etp=2)),
     "does not divide num_experts=4"),
    (lambda: vllm_shards(QWEN3_MOE.with_(moe_ffn=66), 4), "expert_ffn|units are not divisible"),
])
def test_impossible_expert_grids_are_refused_with_the_reason(make, message):
    with pytest.raises(Exception, match=message):
        make()
