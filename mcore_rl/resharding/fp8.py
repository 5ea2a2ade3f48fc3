"""Block-wise FP8 inside a sync plan: which transfers a trainer rank can send already
quantized, what that saves on the wire, and the arithmetic, equal to vLLM's own.

vLLM's online block-wise FP8 (`quantization="fp8_per_block"`) quantizes each engine rank's
local linear weight (fused q/k/v and gate/up included; a stacked MoE tensor expert by expert)
in 128×128 blocks (`vllm.utils.deep_gemm.per_block_cast_to_fp8`): a block's scale is its
largest magnitude (at least 1e-4) over the FP8 maximum, and each element becomes
fp8(x · (1/scale)). A block's numbers depend on its own elements only. So a transfer whose
destination box is a union of whole blocks of the engine rank's tensor (`block_aligned`) can be
quantized by the trainer rank that sends it — one byte per element and one fp32 scale per
block on the wire instead of two bytes per element — and the engine installs exactly what its
own loading would have computed. A transfer off the block grid goes as it does today and is
quantized where all of its blocks arrive: on the engine rank.

Which engine tensors vLLM quantizes is the layout table's `Side.fp8` (layouts/families.py).
Pure: no process group, no vLLM import (trainer ranks never import vLLM).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_rl.layouts.layout import Box, box_numel
from mcore_rl.resharding.planner import Plan, Transfer

# vLLM's block (rows, columns) of the block-wise FP8 weight scheme
BLOCK = (128, 128)
FP8_DTYPE = torch.float8_e4m3fn
# the smallest block maximum vLLM divides by (an all-zero block keeps a finite scale)
MIN_BLOCK_AMAX = 1e-4
SCALE_BYTES = 4  # one fp32 scale per block


def block_aligned(box: Box, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> bool:
    """Whether `box` of a tensor of `shape` covers whole quantization blocks of the tensor's
    last two dims (a block at the tensor's edge, short of a full block, counts as whole when
    the box reaches that edge). Leading dims (a stacked expert's slot) are not blocked."""
    for (start, stop), size, b in zip(box[-2:], shape[-2:], block, strict=True):
        if start % b or (stop % b and stop != size):
            return False
    return True


def blocks_of(box: Box, block: tuple[int, int] = BLOCK) -> Box:
    """The box of scale entries a block-aligned `box` covers (leading dims as they are)."""
    lead = tuple(box[:-2])
    grid = tuple(
        (start // b, -(-stop // b)) for (start, stop), b in zip(box[-2:], block, strict=True)
    )
    return lead + grid


def sender_quantized(
    plan: Plan, is_fp8: Callable[[str], bool], block: tuple[int, int] = BLOCK
) -> list[list[bool]]:
    """For each round, each transfer: whether its sender quantizes it (its destination tensor
    is one vLLM quantizes, `is_fp8(dst_key)`, and its box lies on the block grid)."""
    return [[_quantizable(plan, t, is_fp8, block) for t in rnd] for rnd in plan.rounds]


def _quantizable(
    plan: Plan, t: Transfer, is_fp8: Callable[[str], bool], block: tuple[int, int]
) -> bool:
    return is_fp8(t.dst_key) and block_aligned(
        t.dst_box, plan.dst_shapes[t.dst_rank][t.dst_key], block
    )


def fp8_wire_bytes(
    plan: Plan,
    is_fp8: Callable[[str], bool],
    *,
    element_size: int = 2,
    block: tuple[int, int] = BLOCK,
) -> dict[str, int]:
    """Bytes on the wire of one sync under block-wise FP8, against the same plan unquantized
    (`element_size`: the wire dtype's, 2 for BF16): sender-quantized elements at one byte plus
    their blocks' scales; the rest (off the grid, or tensors vLLM keeps unquantized) as today.
    """
    fp8_elements = scales = other_elements = 0
    for rnd, flags in zip(plan.rounds, sender_quantized(plan, is_fp8, block), strict=True):
        for t, quantized in zip(rnd, flags, strict=True):
            if quantized:
                fp8_elements += t.numel
                scales += box_numel(blocks_of(t.dst_box, block))
            else:
                other_elements += t.numel
    return {
        "fp8_bytes": fp8_elements,
        "scale_bytes": scales * SCALE_BYTES,
        "unquantized_bytes": other_elements * element_size,
        "total_bytes": fp8_elements + scales * SCALE_BYTES + other_elements * element_size,
        "without_fp8_bytes": (fp8_elements + other_elements) * element_size,
    }


def quantize_blocks(
    x: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [..., m, n] in 128×128 blocks of its last two dims: (fp8 [..., m, n], fp32 scales
    [..., ⌈m/128⌉, ⌈n/128⌉]) — vLLM's `per_block_cast_to_fp8` (with `use_ue8m0=False`), applied
    to each matrix of a stacked tensor. The same numbers for a block-aligned part of a tensor
    as for the whole (each block on its own)."""
    *lead, m, n = x.shape
    bm, bn = block
    rows, cols = -(-m // bm), -(-n // bn)
    padded = x.new_zeros(*lead, rows * bm, cols * bn)
    padded[..., :m, :n] = x
    view = padded.view(*lead, rows, bm, cols, bn)
    amax = view.abs().float().amax(dim=(-3, -1), keepdim=True).clamp(MIN_BLOCK_AMAX)
    scale = amax / torch.finfo(FP8_DTYPE).max
    quantized = (view * (1.0 / scale)).to(FP8_DTYPE)
    return (
        quantized.view(*lead, rows * bm, cols * bn)[..., :m, :n].contiguous(),
        scale.view(*lead, rows, cols),
    )


__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "block_aligned",
    "blocks_of",
    "fp8_wire_bytes",
    "quantize_blocks",
    "sender_quantized",
]
