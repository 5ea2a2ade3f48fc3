"""Parameter layouts as data: family tables (HF ↔ Megatron ↔ vLLM) and their per-rank
expansion into shard maps."""

from mcore_rl.layouts.families import FAMILIES, family_table
from mcore_rl.layouts.layout import Box, LocalTensor, Piece, Row, ShardMap, Side
from mcore_rl.layouts.shards import (LayoutError, assemble_hf, hf_shards, materialize_rank,
                                     megatron_shards, validate_megatron_grid, vllm_shards)

__all__ = ["FAMILIES", "Box", "LayoutError", "LocalTensor", "Piece", "Row", "ShardMap", "Side",
           "assemble_hf", "family_table", "hf_shards", "materialize_rank", "megatron_shards",
           "validate_megatron_grid", "vllm_shards"]
