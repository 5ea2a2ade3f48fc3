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
own loading would have computed. The sync decides per engine tensor (`sender_tensors`): one
every region of which is sent on the grid is quantized by its senders (`block_parts`,
`block_quantized_sources`: each region quantized on its own, with its blocks' scales); one
with any region off the grid crosses in the engines' dtype and is quantized whole where all
of its blocks arrive: on the engine rank, by vLLM's own function (`rollout/install.py`).

vLLM's online per-tensor FP8 (`quantization="fp8_per_tensor"`) gives a linear weight one
scale: its largest magnitude over the whole logical tensor — vLLM all-reduces each TP rank's
amax over the TP group (`amax_for_tp_weight_quant`) — over the FP8 maximum; a stacked MoE
tensor one scale per expert, over the whole expert (`amax_for_moe_weight_quant`); each element
becomes fp8(x · (1/scale)), clamped (the static cast, `QuantFP8.forward_native`). Once the
trainer ranks know each logical tensor's amax — a MAX all-reduce of one float per logical tensor
(`tensor_units`: the HF tensors a scale spans) — every transfer into such a tensor can be
quantized by its sender, on the grid or off it.

Which engine tensors vLLM quantizes is the layout table's `Side.fp8` (layouts/families.py).
Pure: no process group, no vLLM import (trainer ranks never import vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from mcore_rl.layouts.layout import Box, ShardMap, box_numel, box_slices
from mcore_rl.resharding.planner import Fp8Units, Plan, Transfer

# vLLM's online FP8 methods, by their `quantization=` names
SCHEMES = ("fp8_per_tensor", "fp8_per_block")
# vLLM's block (rows, columns) of the block-wise FP8 weight scheme
BLOCK = (128, 128)
FP8_DTYPE = torch.float8_e4m3fn
# the smallest block maximum vLLM divides by (an all-zero block keeps a finite scale)
MIN_BLOCK_AMAX = 1e-4
SCALE_BYTES = 4  # one fp32 scale per block (per tensor, per expert)
FP8_MAX = torch.finfo(FP8_DTYPE).max

# the logical tensor a per-tensor scale spans: the HF tensors it is made of
Unit = frozenset[str]


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
    plan: Plan,
    is_fp8: Callable[[str], bool],
    block: tuple[int, int] = BLOCK,
    scheme: str = "fp8_per_block",
) -> list[list[bool]]:
    """For each round, each transfer: whether its sender quantizes it — its destination
    tensor is one vLLM quantizes (`is_fp8(dst_key)`) and, block-wise, every region of that
    tensor lies on the block grid (`sender_tensors`); per tensor, every such transfer (its
    scale is known to every sender)."""
    _check_scheme(scheme)
    senders = sender_tensors(plan, is_fp8, block) if scheme == "fp8_per_block" else None
    return [[_quantizable(plan, t, is_fp8, senders) for t in rnd] for rnd in plan.rounds]


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"FP8 scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")


def _quantizable(
    plan: Plan, t: Transfer, is_fp8: Callable[[str], bool], senders: set | None
) -> bool:
    if not is_fp8(t.dst_key):
        return False
    return senders is None or (t.dst_rank, t.dst_key) in senders


def fp8_wire_bytes(
    plan: Plan,
    is_fp8: Callable[[str], bool],
    *,
    element_size: int = 2,
    block: tuple[int, int] = BLOCK,
    scheme: str = "fp8_per_block",
    units: dict | None = None,
    flags: list[list[bool]] | None = None,
) -> dict[str, float]:
    """Bytes on the wire of one sync under FP8 `scheme`, against the same plan unquantized
    (`element_size`: the wire dtype's, 2 for BF16): sender-quantized elements at one byte plus
    their scales (block-wise: a block's; per tensor: one per tensor, per expert of a stacked
    one, and receiving rank); the rest (off the grid, or tensors vLLM keeps unquantized) as
    today. Per tensor, `amax_bytes` is what the trainer ranks all-reduce first: one float per
    logical tensor (`units`: `tensor_units` of the engines' layout; 0 without them), not
    counted in total_bytes (it is not sent to the engines). `ratio`: total / unquantized;
    `sender_share`: of the FP8 tensors' elements, those the senders quantize. flags: the
    plan's `sender_quantized`, when the caller has it already."""
    fp8_elements = scales = other_elements = fp8_tensor_elements = 0
    per_tensor: set[tuple[int, str, int]] = set()
    flags = flags if flags is not None else sender_quantized(plan, is_fp8, block, scheme)
    for rnd, rnd_flags in zip(plan.rounds, flags, strict=True):
        for t, quantized in zip(rnd, rnd_flags, strict=True):
            if not quantized:
                other_elements += t.numel
                fp8_tensor_elements += t.numel if is_fp8(t.dst_key) else 0
                continue
            fp8_elements += t.numel
            if scheme == "fp8_per_block":
                scales += box_numel(blocks_of(t.dst_box, block))
            else:
                per_tensor.add((t.dst_rank, t.dst_key, _slot(t.dst_box)))
    scales += len(per_tensor)
    fp8_tensor_elements += fp8_elements
    logical = ordered_units(units) if units and scheme == "fp8_per_tensor" else []
    total = fp8_elements + scales * SCALE_BYTES + other_elements * element_size
    without = (fp8_elements + other_elements) * element_size
    return {
        "fp8_bytes": fp8_elements,
        "scale_bytes": scales * SCALE_BYTES,
        "unquantized_bytes": other_elements * element_size,
        "total_bytes": total,
        "without_fp8_bytes": without,
        "amax_bytes": len(logical) * SCALE_BYTES,
        "ratio": total / without if without else 1.0,
        "sender_share": fp8_elements / fp8_tensor_elements if fp8_tensor_elements else 0.0,
    }


def _slot(box: Box) -> int:
    """The stacked expert slot a 3-D box lies in (one per transfer), -1 for a 2-D box."""
    if len(box) == 2:
        return -1
    start, stop = box[0]
    if stop - start != 1:
        raise ValueError(f"a transfer into a stacked tensor spans experts {start}..{stop - 1}")
    return start


def tensor_units(dst: ShardMap, num_src: int, is_fp8: Callable[[str], bool]) -> dict:
    """Per tensor FP8: for every region of an FP8 tensor an engine rank holds — (plan rank,
    key, expert slot or -1) — the logical tensor its scale spans, as the HF tensors it is made
    of: the whole fused weight (every TP rank's shard reads the same HF tensors) or one whole
    expert. Regions of one logical tensor, on any rank of any engine, share one unit."""
    units: dict[tuple[int, str, int], Unit] = {}
    for rank, tensors in dst.ranks.items():
        for key, local in tensors.items():
            if not is_fp8(key):
                continue
            by_slot: dict[int, set[str]] = {}
            for piece in local.pieces:
                slot = _slot(piece.local_box) if len(local.shape) == 3 else -1
                by_slot.setdefault(slot, set()).add(piece.hf_name)
            for slot, names in by_slot.items():
                units[(num_src + rank, key, slot)] = frozenset(names)
    return units


def transfer_units(plan: Plan, units: dict) -> list[list[Unit | None]]:
    """For each round, each transfer: the logical tensor whose amax it contributes to (None:
    not an FP8 tensor). A sender computes its transfers' amaxes; one MAX all-reduce over the
    trainer ranks, indexed by `ordered_units`, gives every sender every scale."""
    keys = {key for _, key, _ in units}
    return [
        [
            units[(t.dst_rank, t.dst_key, _slot(t.dst_box))] if t.dst_key in keys else None
            for t in rnd
        ]
        for rnd in plan.rounds
    ]


def ordered_units(units: dict) -> list[Unit]:
    """Every logical FP8 tensor once, in an order every rank computes alike (the index of its
    amax in the all-reduced vector)."""
    return sorted(set(units.values()), key=sorted)


def scale_name(key: str) -> str:
    """vLLM's name of an FP8 linear weight's per-tensor scale parameter."""
    return key.removesuffix("weight") + "weight_scale"


def per_tensor_units(plan: Plan, dst: ShardMap, is_fp8: Callable[[str], bool]) -> Fp8Units:
    """`plan` (to the engines of `dst`) under per-tensor FP8, as data (`Fp8Units`): each
    transfer's logical tensor, each engine rank's scale parameters — one scale per linear
    weight, one per local expert of a stacked expert tensor (vLLM's fused-expert layers hold
    them as a vector, in slot order)."""
    units = tensor_units(dst, plan.num_src, is_fp8)
    order = {unit: i for i, unit in enumerate(ordered_units(units))}
    by_slot: dict[int, dict[str, dict[int, int]]] = {}
    for (rank, key, slot), unit in units.items():
        by_slot.setdefault(rank, {}).setdefault(scale_name(key), {})[slot] = order[unit]
    scales = {
        rank: {name: tuple(slots[s] for s in sorted(slots)) for name, slots in names.items()}
        for rank, names in sorted(by_slot.items())
    }
    per_transfer = tuple(
        tuple(-1 if unit is None else order[unit] for unit in rnd)
        for rnd in transfer_units(plan, units)
    )
    shapes: dict[int, dict[str, tuple[int, ...]]] = {
        d: {name: (len(slots),) for name, slots in names.items()} for d, names in scales.items()
    }
    return Fp8Units("fp8_per_tensor", len(order), per_transfer, scales, shapes)


def block_scale_name(key: str) -> str:
    """vLLM's name of an FP8 linear weight's block scales (its block method's)."""
    return key.removesuffix("weight") + "weight_scale_inv"


def scale_grid(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The shape of a weight's block scales: one per block of its last two dims."""
    *lead, m, n = shape
    return (*lead, -(-m // block[0]), -(-n // block[1]))


def sender_tensors(
    plan: Plan, is_fp8: Callable[[str], bool], block: tuple[int, int] = BLOCK
) -> set[tuple[int, str]]:
    """Block-wise: the engine tensors — (destination sync rank, key) — the senders quantize:
    FP8 tensors every region of which is sent on the block grid. A tensor with any region off
    the grid arrives in the engines' dtype and its engine rank quantizes it whole (a block
    split between two senders is quantized where all of it arrives)."""
    aligned: dict[tuple[int, str], bool] = {}
    for rnd in plan.rounds:
        for t in rnd:
            if is_fp8(t.dst_key):
                key = (t.dst_rank, t.dst_key)
                shape = plan.dst_shapes[t.dst_rank][t.dst_key]
                aligned[key] = aligned.get(key, True) and block_aligned(t.dst_box, shape, block)
    return {key for key, ok in aligned.items() if ok}


def per_block_units(plan: Plan, dst: ShardMap, is_fp8: Callable[[str], bool]) -> Fp8Units:
    """`plan` (to the engines of `dst`) under block-wise FP8, as data (`Fp8Units`): the
    transfers the senders quantize (`sender_tensors`), numbered, and each engine rank's block
    scales (a stacked expert tensor's: each expert's grid, in slot order)."""
    senders = sender_tensors(plan, is_fp8)
    numbered = 0
    per_transfer = []
    for rnd in plan.rounds:
        row = []
        for t in rnd:
            row.append(numbered if (t.dst_rank, t.dst_key) in senders else -1)
            numbered += row[-1] >= 0
        per_transfer.append(tuple(row))
    shapes = {
        d: {block_scale_name(k): scale_grid(shape) for k, shape in keys.items() if is_fp8(k)}
        for d, keys in plan.dst_shapes.items()
    }
    shapes = {d: names for d, names in shapes.items() if names}
    return Fp8Units("fp8_per_block", 0, tuple(per_transfer), {}, shapes)


def with_fp8(plan: Plan, dst: ShardMap, is_fp8: Callable[[str], bool], scheme: str) -> Plan:
    """`plan` (to the engines of `dst`) with the FP8 tensors (`is_fp8`) quantized inside it
    under `scheme` (`per_tensor_units`, `per_block_units`)."""
    _check_scheme(scheme)
    units = per_tensor_units if scheme == "fp8_per_tensor" else per_block_units
    return replace(plan, fp8=units(plan, dst, is_fp8))


def fp8_parts(plan: Plan) -> tuple[Plan, Plan]:
    """An FP8 plan's transfers as two plans of their own, in plan order: those that cross in
    the engines' dtype, and those the senders quantize (one byte per element, sent as uint8).
    Every rank derives the same two from the plan it verified; computed once per plan.
    Block-wise, the second part's transfers send from one quantized region each
    (`block_parts`)."""
    cached = plan.__dict__.get("_fp8_parts")
    if cached is not None:
        return cached
    if plan.fp8 is None:
        raise ValueError("the plan has no FP8 tensors")
    units = plan.fp8.transfer_unit
    quantized = {
        (t.dst_rank, t.dst_key)
        for rnd, us in zip(plan.rounds, units, strict=True)
        for t, u in zip(rnd, us, strict=True)
        if u >= 0
    }

    def part(fp8: bool) -> Plan:
        rounds = [
            [t for t, u in zip(rnd, us, strict=True) if (u >= 0) == fp8]
            for rnd, us in zip(plan.rounds, units, strict=True)
        ]
        shapes = {
            d: {k: s for k, s in keys.items() if ((d, k) in quantized) == fp8}
            for d, keys in plan.dst_shapes.items()
        }
        return Plan(
            [rnd for rnd in rounds if rnd],
            shapes,
            plan.num_src,
            plan.num_dst,
            1 if fp8 else plan.element_size,
            plan.bucket_bytes,
            plan.src_labels,
            plan.dst_labels,
        )

    parts = plan.__dict__["_fp8_parts"] = (part(False), part(True))
    return parts


def _region_key(t: Transfer, number: int) -> str:
    """The name a sender's quantized region (or its scales) travels under: one per transfer."""
    return f"{t.src_key}#fp8/{number}"


def _dims(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, size) for size in shape)


def block_parts(plan: Plan) -> tuple[Plan, Plan, Plan]:
    """A block-wise FP8 plan as three plans of their own, every rank deriving the same from
    the plan it verified (computed once per plan): the transfers that cross in the engines'
    dtype (an engine rank quantizes the FP8 tensors among them); those the senders quantize,
    each from its own region (one byte per element, as uint8); and each such region's block
    scales (fp32) into the scale parameter's box of the blocks it covers."""
    cached = plan.__dict__.get("_block_parts")
    if cached is not None:
        return cached
    if plan.fp8 is None or plan.fp8.scheme != "fp8_per_block":
        raise ValueError("the plan has no block-wise FP8 tensors")
    rest, senders = fp8_parts(plan)
    regions, scales = [], []
    region_shapes: dict[int, dict[str, tuple[int, ...]]] = {}
    scale_shapes: dict[int, dict[str, tuple[int, ...]]] = {}
    for rnd, numbers in zip(plan.rounds, plan.fp8.transfer_unit, strict=True):
        region_row, scale_row = [], []
        for t, number in zip(rnd, numbers, strict=True):
            if number < 0:
                continue
            name = _region_key(t, number)
            region_row.append(replace(t, src_key=name, src_box=_whole(_dims(t.dst_box))))
            grid = blocks_of(t.dst_box)
            scale_key = block_scale_name(t.dst_key)
            scale_row.append(
                Transfer(t.src_rank, name, _whole(_dims(grid)), t.dst_rank, scale_key, grid)
            )
            region_shapes.setdefault(t.dst_rank, {})[t.dst_key] = senders.dst_shapes[t.dst_rank][
                t.dst_key
            ]
            scale_shapes.setdefault(t.dst_rank, {})[scale_key] = plan.fp8.scale_shapes[t.dst_rank][
                scale_key
            ]
        if region_row:
            regions.append(region_row)
            scales.append(scale_row)

    def part(rounds, shapes, element_size):
        return Plan(
            rounds,
            shapes,
            plan.num_src,
            plan.num_dst,
            element_size,
            plan.bucket_bytes,
            plan.src_labels,
            plan.dst_labels,
        )

    parts = plan.__dict__["_block_parts"] = (
        rest,
        part(regions, region_shapes, 1),
        part(scales, scale_shapes, SCALE_BYTES),
    )
    return parts


def block_quantized_sources(
    plan: Plan, src_rank: int, tensors, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What this sender's quantized and scale parts (`block_parts`) send from: each region it
    sends into an FP8 tensor, in the engines' `dtype`, quantized in the 128×128 blocks of the
    engine rank's tensor — the region starts on that grid — as uint8 bytes, and its blocks'
    scales (fp32), both under the region's own name."""
    regions: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for t, number in _quantized_transfers(plan, src_rank):
        region = tensors[t.src_key][box_slices(t.src_box)].to(dtype).reshape(_dims(t.dst_box))
        quantized, scale = quantize_blocks(region)
        name = _region_key(t, number)
        regions[name], scales[name] = quantized.view(torch.uint8), scale
    return regions, scales


def _quantized_transfers(plan: Plan, src_rank: int):
    """(transfer, unit) of every transfer sync rank `src_rank` sends into an FP8 tensor."""
    assert plan.fp8 is not None
    for rnd, units in zip(plan.rounds, plan.fp8.transfer_unit, strict=True):
        for t, unit in zip(rnd, units, strict=True):
            if unit >= 0 and t.src_rank == src_rank:
                yield t, unit


def sent_amax(plan: Plan, src_rank: int, tensors, dtype: torch.dtype) -> torch.Tensor:
    """This sender's largest magnitude of each logical FP8 tensor (fp32 [units], on its
    tensors' device: one copy to the host after, not one per region), over the regions it
    sends into it, each in the engines' `dtype` (as vLLM loads them); 0 for the tensors it
    sends nothing of. A MAX over every sync rank gives each tensor's amax."""
    assert plan.fp8 is not None
    device = next((t.device for t in tensors.values()), torch.device("cpu"))
    amax = torch.zeros(plan.fp8.count, dtype=torch.float32, device=device)
    for t, unit in _quantized_transfers(plan, src_rank):
        region = tensors[t.src_key][box_slices(t.src_box)].to(dtype)
        amax[unit] = torch.maximum(amax[unit], weight_amax(region).float())
    return amax


def quantized_sources(
    plan: Plan, src_rank: int, tensors, dtype: torch.dtype, amax: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What this sender's FP8 part sends from (`fp8_parts`): per source tensor, a uint8 copy
    whose every region sent into an FP8 tensor holds that region in the engines' `dtype`
    quantized with its logical tensor's scale (all-reduced `amax`); the rest is not sent."""
    out: dict[str, torch.Tensor] = {}
    scales = tensor_scale(amax.to(dtype))
    on_device: dict[torch.device, torch.Tensor] = {}  # the scales copied once per device
    for t, unit in _quantized_transfers(plan, src_rank):
        source = tensors[t.src_key]
        if t.src_key not in out:
            out[t.src_key] = torch.zeros(source.shape, dtype=torch.uint8, device=source.device)
        if source.device not in on_device:
            on_device[source.device] = scales.to(source.device)
        box = box_slices(t.src_box)
        scale = on_device[source.device][unit].reshape(1)
        out[t.src_key][box] = quantize_with_scale(source[box].to(dtype), scale).view(torch.uint8)
    return out


def installed_scales(
    plan: Plan, dst_rank: int, amax: torch.Tensor, dtype: torch.dtype
) -> list[tuple[str, torch.Tensor]]:
    """Engine rank `dst_rank`'s scale parameters (fp32 [1] each, [local experts] for a
    stacked expert tensor) from the all-reduced amax of the weights it holds in `dtype` —
    the scales the senders quantized them with."""
    assert plan.fp8 is not None
    scales = tensor_scale(amax.to(dtype))
    return [
        (name, scales[list(units)]) for name, units in plan.fp8.scales.get(dst_rank, {}).items()
    ]


def weight_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of `x`, in x's dtype (vLLM's `weight_amax`)."""
    lo, hi = x.aminmax()
    return torch.maximum(lo.abs(), hi.abs())


def tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """vLLM's per-tensor weight scale of a logical tensor's amax: fp32 amax / FP8 maximum."""
    return amax.to(torch.float32) / FP8_MAX


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's static per-tensor FP8 cast (`QuantFP8.forward_native`): fp32 x times the
    scale's reciprocal, clamped to the FP8 range. Elementwise: a region's bytes are the same
    whoever quantizes it."""
    inverse = scale.to(torch.float32).reciprocal()
    return (x.to(torch.float32) * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


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
    "FP8_MAX",
    "SCHEMES",
    "block_aligned",
    "block_parts",
    "block_quantized_sources",
    "block_scale_name",
    "blocks_of",
    "fp8_parts",
    "fp8_wire_bytes",
    "installed_scales",
    "ordered_units",
    "per_block_units",
    "per_tensor_units",
    "quantize_blocks",
    "quantize_with_scale",
    "quantized_sources",
    "scale_grid",
    "scale_name",
    "sender_quantized",
    "sender_tensors",
    "sent_amax",
    "tensor_scale",
    "tensor_units",
    "transfer_units",
    "weight_amax",
    "with_fp8",
]
