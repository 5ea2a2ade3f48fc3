"""`models.gpt.layer_spec(name)`: the spec the run resolved, never one picked by the hardware;
"te" without TransformerEngine fails at once, naming `layer_spec` and TransformerEngine."""

import pytest

from mcore_rl.models.gpt import LayerSpecError, build_gpt_model, layer_spec, te_importable
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_local_spec_is_megatron_local_spec_with_rmsnorm():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = layer_spec("local")
    assert spec.submodules.input_layernorm is WrappedTorchNorm
    assert spec.submodules.sharded_state_dict_keys_map == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


@pytest.mark.skipif(te_importable(), reason="TransformerEngine is importable here: the "
                    "refusal it tests cannot happen (tests/models/test_gpu_layer_spec.py "
                    "builds the TE spec instead)")
def test_te_without_transformer_engine_is_a_clear_error():
    with pytest.raises(LayerSpecError, match=r"layer_spec='te' needs TransformerEngine"):
        layer_spec("te")
    # before megatron builds anything (no groups needed to get the error)
    with pytest.raises(LayerSpecError, match="TransformerEngine"):
        build_gpt_model(get_preset("micro"), ParallelConfig(), groups=None, layer_spec="te")


def test_unknown_layer_spec_names_the_choices():
    with pytest.raises(ValueError, match="layer_spec='transformer_engine': one of local, te"):
        layer_spec("transformer_engine")
