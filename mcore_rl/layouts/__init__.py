"""Parameter layouts as data: family tables (HF ↔ Megatron ↔ vLLM) and their per-rank
expansion into shard maps."""

from mcore_rl.layouts.expert_placement import vllm_local_experts
from mcore_rl.layouts.families import FAMILIES, family_table
from mcore_rl.layouts.layout import Box, LocalTensor, Piece, Row, ShardMap, Side
from mcore_rl.layouts.shards import (
    LayoutError,
    assemble_hf,
    extra_state_modules,
    hf_shards,
    materialize_rank,
    megatron_shards,
    validate_megatron_grid,
    vllm_fp8_names,
    vllm_shards,
)
from mcore_rl.models.spec import LAYER_SPECS, LayerSpec

__all__ = [
    "FAMILIES",
    "LAYER_SPECS",
    "Box",
    "LayerSpec",
    "LayoutError",
    "LocalTensor",
    "Piece",
    "Row",
    "ShardMap",
    "Side",
    "assemble_hf",
    "extra_state_modules",
    "family_table",
    "hf_shards",
    "materialize_rank",
    "megatron_shards",
    "validate_megatron_grid",
    "vllm_fp8_names",
    "vllm_local_experts",
    "vllm_shards",
]
