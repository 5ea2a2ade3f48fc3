"""The TransformerEngine-spec names of the layout tables against a golden key list taken from
megatron-core 0.16.1 itself, with no TE and no CUDA.

How the golden list is obtained (`te_golden_keys`):
1. The module tree: megatron-core's own `get_gpt_layer_with_transformer_engine_spec()` is called
   and its `ModuleSpec` tree walked. Without TE, `megatron/core/extensions/transformer_engine.py`
   replaces `te` by a MagicMock, so its TE wrapper classes (`TELayerNormColumnParallelLinear`,
   `TERowParallelLinear`, ...) exist as distinct mock objects; `gpt_layer_specs.py` only skips
   binding `TESpecProvider` (its import sits in a `try` that fails on `import transformer_engine`)
   and `TESpecProvider.layer_norm` asks TE's version. The test binds the provider and answers the
   version for the duration of the call (pytest's monkeypatch; nothing is built), so the tree is
   exactly the one megatron-core builds on a GPU: which module sits at which path.
2. The parameters each TE module registers (TE's source: `pytorch/module/layernorm_linear.py`
   registers `layer_norm_weight` (+ `layer_norm_bias` for LayerNorm, not RMSNorm), `weight` and
   `bias` when biased; `linear.py` `weight` (+ `bias`); `rmsnorm.py` `weight`; TE's
   `DotProductAttention` none (megatron adds `softmax_offset` only for learnable softmax)), and
   where megatron-core passes bias=True (`SelfAttention`: linear_qkv has a bias iff
   add_bias_linear or add_qkv_bias; the others iff add_bias_linear, False here).
3. The model level (`GPTModel`): `embedding.word_embeddings.weight`, the block's
   `final_layernorm` (TENorm → TE RMSNorm: `weight`), `output_layer.weight` (untied) —
   megatron's own VocabParallelEmbedding / ColumnParallelLinear under both specs.
Independently, megatron-core's local spec declares its TE spelling for checkpoints
(`sharded_state_dict_keys_map`); applied to the local names it must give the same TE names.
The check against a model megatron-core builds with TE is tests/models/test_gpu_layer_spec.py
(GPU with TE only).
"""

from __future__ import annotations

import pytest

from mcore_rl.layouts import extra_state_modules, megatron_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

MICRO = get_preset("micro")
SPECS = {
    "llama": MICRO,
    "qwen2-bias": MICRO.with_(family="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True),
    "qwen2-tied": MICRO.with_(family="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True,
                              tied_embeddings=True),
}

# What each TE module class registers (step 2 of the module docstring). Normalization is RMSNorm
# (models.gpt.transformer_config_from_spec), so no layer_norm_bias.
TE_PARAMS = {
    "TELayerNormColumnParallelLinear": ("layer_norm_weight", "weight"),
    "TEColumnParallelLinear": ("weight",),
    "TERowParallelLinear": ("weight",),
    "TEDotProductAttention": (),
}


@pytest.fixture(scope="module")
def te_layer_tree():
    """{module path inside a layer: TE class name} of megatron-core's TE layer spec."""
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.gpt_layer_specs as specs

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specs, "TESpecProvider", provider.TESpecProvider, raising=False)
        mp.setattr(provider, "is_te_min_version", lambda *a, **k: True)
        layer = specs.get_gpt_layer_with_transformer_engine_spec()
    te_classes = {id(getattr(te_ext, name)): name for name in TE_PARAMS}
    tree = {}

    def walk(node, path):
        module = getattr(node, "module", node)
        if id(module) in te_classes:
            tree[path] = te_classes[id(module)]
        sub = getattr(node, "submodules", None)
        for field in getattr(sub, "__dataclass_fields__", {}):
            walk(getattr(sub, field), f"{path}.{field}" if path else field)

    walk(layer, "")
    # The dense TE layer: no module of its own for either norm (both fused into a linear).
    from megatron.core.transformer.identity_op import IdentityOp

    assert layer.submodules.input_layernorm is IdentityOp
    assert layer.submodules.pre_mlp_layernorm is IdentityOp
    return tree


def te_golden_keys(tree: dict[str, str], spec) -> set[str]:
    keys = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if not spec.tied_embeddings:
        keys.add("output_layer.weight")
    for layer in range(spec.layers):
        for path, cls in tree.items():
            params = list(TE_PARAMS[cls])
            if path == "self_attention.linear_qkv" and spec.qkv_bias:
                params.append("bias")
            keys |= {f"decoder.layers.{layer}.{path}.{p}" for p in params}
    return keys


def test_te_layer_tree_is_what_the_tables_assume(te_layer_tree):
    assert te_layer_tree == {
        "self_attention.linear_qkv": "TELayerNormColumnParallelLinear",
        "self_attention.core_attention": "TEDotProductAttention",
        "self_attention.linear_proj": "TERowParallelLinear",
        "mlp.linear_fc1": "TELayerNormColumnParallelLinear",
        "mlp.linear_fc2": "TERowParallelLinear",
    }


@pytest.mark.parametrize("name", SPECS)
def test_te_names_equal_megatron_core_te_spec(te_layer_tree, name):
    spec = SPECS[name]
    ours = set(megatron_shards(spec, ParallelConfig(), layer_spec="te").ranks[0])
    assert ours == te_golden_keys(te_layer_tree, spec)


@pytest.mark.parametrize("name", SPECS)
def test_local_spec_checkpoint_map_gives_the_same_te_names(name):
    """megatron-core's local spec states how its names read in TE spelling (for dist
    checkpoints): our local names through that map are our TE names, tensor for tensor."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules \
        .sharded_state_dict_keys_map
    spec = SPECS[name]
    local = megatron_shards(spec, ParallelConfig(tp=2, pp=2), layer_spec="local")
    te = megatron_shards(spec, ParallelConfig(tp=2, pp=2), layer_spec="te")
    for rank in local.ranks:
        renamed = {}
        for key, tensor in local.ranks[rank].items():
            for old, new in keys_map.items():
                key = key.replace(f".{old}", f".{new}")
            renamed[key] = tensor
        assert set(renamed) == set(te.ranks[rank])
        for key, tensor in renamed.items():  # same shapes, same HF pieces
            assert tensor.shape == te.ranks[rank][key].shape
            assert tensor.pieces == te.ranks[rank][key].pieces


def test_extra_state_modules_are_the_te_linears(te_layer_tree):
    linears = {path for path, cls in te_layer_tree.items() if "Linear" in cls}
    for layer_spec in ("local", "te"):
        got = extra_state_modules(MICRO, layer_spec)
        assert {m.removeprefix("decoder.layers.{layer}.") for m in got} == linears


MICRO_MOE = get_preset("micro-moe")


@pytest.fixture(scope="module")
def te_moe_experts():
    """The experts' module tree of the layer spec our builder asks megatron-core for under
    "te" (`models.gpt.layer_spec`), for a MoE spec: {path inside the layer: class name}.

    Without TE, megatron-core leaves its grouped TE linears unbound (None, and the provider
    would fall back to the legacy GroupedMLP); the test binds stand-in classes to those two
    names so the tree is the one megatron-core builds on a GPU."""
    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.gpt_layer_specs as specs

    import mcore_rl.models.gpt as gpt

    grouped = {"TEColumnParallelGroupedLinear": type("TEColumnParallelGroupedLinear", (), {}),
               "TERowParallelGroupedLinear": type("TERowParallelGroupedLinear", (), {})}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specs, "TESpecProvider", provider.TESpecProvider, raising=False)
        mp.setattr(provider, "is_te_min_version", lambda *a, **k: True)
        mp.setattr(gpt, "te_importable", lambda: True)
        for name, cls in grouped.items():
            mp.setattr(provider, name, cls)
        layer = gpt.layer_spec("te", MICRO_MOE)
    experts = layer.submodules.mlp.submodules.experts
    sub = experts.submodules
    return {"mlp.experts": experts.module.__name__,
            "mlp.experts.linear_fc1": sub.linear_fc1.__name__,
            "mlp.experts.linear_fc2": sub.linear_fc2.__name__}


def test_te_spec_runs_the_experts_as_one_grouped_gemm(te_moe_experts):
    assert te_moe_experts == {"mlp.experts": "TEGroupedMLP",
                              "mlp.experts.linear_fc1": "TEColumnParallelGroupedLinear",
                              "mlp.experts.linear_fc2": "TERowParallelGroupedLinear"}


@pytest.mark.parametrize("grid", [ParallelConfig(), ParallelConfig(dp=2, ep=2),
                                  ParallelConfig(tp=2, dp=2, ep=2, etp=2)],
                         ids=["ep1", "ep2", "tp2-ep2-etp2"])
def test_te_expert_names_are_te_grouped_linear_parameters(grid):
    """TE's GroupedLinear registers local expert j's weight as `weight<j>` (grouped_linear.py;
    megatron-core's TEGroupedLinear reads `weight{gemm_idx}`): under "te" every rank's expert
    tensors are `mlp.experts.linear_fc<1|2>.weight<j>`, j over its local experts, each the
    tensor SequentialMLP holds for that expert (same shape, same HF pieces)."""
    spec = MICRO_MOE
    local = megatron_shards(spec, grid, layer_spec="local")
    te = megatron_shards(spec, grid, layer_spec="te")
    per_rank = spec.num_experts // grid.ep
    for rank in te.ranks:
        te_experts = {k for k in te.ranks[rank] if ".experts." in k}
        assert te_experts == {f"decoder.layers.{layer}.mlp.experts.linear_fc{i}.weight{j}"
                              for layer in range(spec.layers) for i in (1, 2)
                              for j in range(per_rank)}
        for key in te_experts:
            head, rest = key.split(".mlp.experts.")
            linear, j = rest.split(".weight")
            twin = local.ranks[rank][f"{head}.mlp.experts.local_experts.{j}.{linear}.weight"]
            assert te.ranks[rank][key].shape == twin.shape
            assert te.ranks[rank][key].pieces == twin.pieces
        assert len(te.ranks[rank]) == len(local.ranks[rank])


def test_unknown_layer_spec_is_refused_with_the_field():
    from mcore_rl.layouts import LayoutError

    with pytest.raises(LayoutError, match="layer_spec='transformer_engine': one of local, te"):
        megatron_shards(MICRO, ParallelConfig(), layer_spec="transformer_engine")
