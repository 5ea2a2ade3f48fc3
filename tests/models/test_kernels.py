"""megatron's fusion switches as the run plan's `fused_kernels` sets them (S3): exactly the two
TransformerEngine kernels, never a fusion megatron compiles with torch.compile."""

import pytest

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
