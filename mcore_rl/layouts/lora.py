"""LoRA adapters' layouts, derived from the layouts of the weights they adapt — no table of
their own.

The adapter of a weight W [out, in] holds A [r, in] and B [out, r] (ΔW = scale·B·A). B's rows
are W's rows and A's columns are W's columns, so however a side splits or fuses W's rows
(columns) it splits or fuses B's rows (A's columns) the same way, and holds the other matrix
whole: a column-parallel W gives B split as W's rows and A whole; a row-parallel W gives A
split as W's columns and B whole. Each piece of W (`local[rows, cols]` holds
`hf[rows', cols']`) so gives a piece of B (`B[rows, :r]` ↔ `lora_B(hf)[rows', :r]`) and one
of A (`A[:r, cols]` ↔ `lora_A(hf)[:r, cols']`).

HF names are PEFT's: `<hf weight name without .weight>.lora_A.weight` and `.lora_B.weight`.
A weight fusing several HF tensors (q/k/v, gate/up) has one A: every HF part's lora_A is that
A (ΔW_q = B_q·A), as PEFT states a fused adapter.
"""

from __future__ import annotations

from collections.abc import Iterable

from mcore_rl.layouts.layout import LocalTensor, Piece, ShardMap

# The adapter of `<module>.weight` on a Megatron rank: child module `lora` of the linear.
ADAPTER_PARAMS = {"A": "lora.lora_a", "B": "lora.lora_b"}


def adapted_weights(smap: ShardMap, targets: Iterable[str]) -> list[str]:
    """Keys of every rank's weights an adapter sits on: `<...>.<target>.weight` for each
    target linear's short name (routed experts excluded); `output_layer.weight` is a
    top-level module's, prefixed only by a VPP chunk's `model<v>.`."""
    names = tuple(f"{t}.weight" for t in targets)
    keys = {k for tensors in smap.ranks.values() for k in tensors}
    return sorted(
        k
        for k in keys
        if ".experts." not in k and any(k == n or k.endswith(f".{n}") for n in names)
    )


def hf_lora_name(hf_weight: str, which: str) -> str:
    """PEFT's name of an HF weight's adapter matrix `which` ("A" or "B")."""
    return f"{hf_weight.removesuffix('.weight')}.lora_{which}.weight"


def lora_shards(smap: ShardMap, rank: int, targets: Iterable[str]) -> ShardMap:
    """Every rank's adapter tensors (rank `rank`) for the weights of `smap` that `targets`
    adapts, as pieces of the PEFT adapter's HF tensors (see the module docstring)."""
    if rank < 1:
        raise ValueError(f"lora rank={rank}: must be >= 1")
    adapted = set(adapted_weights(smap, targets))
    out = ShardMap(smap.side, smap.family, {}, rank_labels=dict(smap.rank_labels))
    for r, tensors in smap.ranks.items():
        out.ranks[r] = {}
        for key, weight in tensors.items():
            if key in adapted:
                out.ranks[r].update(_adapter_tensors(key, weight, rank, smap, out.hf_shapes))
    return out


def _adapter_tensors(
    key: str, weight: LocalTensor, rank: int, smap: ShardMap, hf_shapes: dict[str, tuple[int, ...]]
) -> dict[str, LocalTensor]:
    module = key.removesuffix(".weight")
    out_local, in_local = weight.shape
    a_pieces: dict[Piece, None] = {}  # ordered, de-duplicated (fused parts repeat A's box)
    b_pieces: dict[Piece, None] = {}
    for p in weight.pieces:
        (rows, cols), (hf_rows, hf_cols) = p.local_box, p.hf_box
        hf_out, hf_in = smap.hf_shapes[p.hf_name]
        a_name, b_name = hf_lora_name(p.hf_name, "A"), hf_lora_name(p.hf_name, "B")
        hf_shapes[a_name], hf_shapes[b_name] = (rank, hf_in), (hf_out, rank)
        a_pieces[Piece(((0, rank), cols), a_name, ((0, rank), hf_cols))] = None
        b_pieces[Piece((rows, (0, rank)), b_name, (hf_rows, (0, rank)))] = None
    a_key, b_key = f"{module}.{ADAPTER_PARAMS['A']}", f"{module}.{ADAPTER_PARAMS['B']}"
    return {
        a_key: LocalTensor(a_key, (rank, in_local), tuple(a_pieces)),
        b_key: LocalTensor(b_key, (out_local, rank), tuple(b_pieces)),
    }


def whole_adapters(adapters: ShardMap, ranks: int) -> ShardMap:
    """`ranks` inference ranks that each hold every adapter tensor of `adapters` whole, keyed
    by its PEFT name: what vLLM's LoRA manager takes (each of its LoRA layers cuts its own
    rank's slice when the adapter is activated)."""
    out = ShardMap("vllm", adapters.family, dict(adapters.hf_shapes))
    for r in range(ranks):
        out.ranks[r] = {
            name: LocalTensor(name, shape, (Piece(_whole(shape), name, _whole(shape)),))
            for name, shape in sorted(adapters.hf_shapes.items())
        }
    return out


def _whole(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


__all__ = ["ADAPTER_PARAMS", "adapted_weights", "hf_lora_name", "lora_shards", "whole_adapters"]
