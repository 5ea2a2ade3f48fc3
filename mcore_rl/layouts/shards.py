"""Expand a family's layout table into per-rank shard maps — one generic function per side —
and move tensors between HF form and a side's form through those maps.

Sharding, per TP rank r of t (see `Side` for the vocabulary):
  split_dim=None          rank r: the whole tensor
  split_dim=d, one part   rank r: units [r·n/t, (r+1)·n/t) of dim d; gather = cat(dim=d)
  fused parts             rank r: cat over parts of each part's rank-r units
  interleave="kv_heads"   rank r: for each of its query groups g: cat over parts of g's units
  replicate_short, n < t  rank r: unit r // (t/n)
  pad_vocab               pad n to P (rule of the side), rank r: rows [r·P/t, (r+1)·P/t),
                          rows ≥ n are zeros
Per-expert rows, per expert-parallel rank e of ep (E experts): experts [e·E/ep, (e+1)·E/ep),
each expert's tensor split as above over the side's expert-TP axis; stack_experts: the rank's
experts stacked on a new leading dim, else one tensor per expert named by its local index.
vLLM with expert parallelism (`vllm_shards(..., expert_parallel=True)`): TP rank r holds the
whole experts vLLM's linear placement gives it (`expert_placement.vllm_local_experts`, uneven
counts allowed), stacked in local order; every other tensor as with TP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from mcore_rl.config import ConfigError
from mcore_rl.layouts.expert_placement import vllm_local_experts
from mcore_rl.layouts.families import family_table
from mcore_rl.layouts.layout import LocalTensor, Piece, Row, ShardMap, Side, box_slices
from mcore_rl.models.spec import LayerSpec, ModelSpec, check_layer_spec
from mcore_rl.parallel.config import ParallelConfig

VLLM_VOCAB_PADDING = (
    64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
)


class LayoutError(ValueError):
    """A model shape cannot be laid out on the requested grid (names tensor and reason)."""


def dim_size(spec: ModelSpec, dim: str) -> tuple[int, int]:
    """(number of units, elements per unit) of a symbolic dim. Heads split whole."""
    return {
        "hidden": (spec.hidden, 1),
        "ffn": (spec.ffn, 1),
        "vocab": (spec.vocab, 1),
        "heads": (spec.heads, spec.head_dim),
        "kv_heads": (spec.kv_heads, spec.head_dim),
        "labels": (spec.num_labels or 0, 1),
        "head_dim": (spec.head_dim, 1),
        "experts": (spec.num_experts or 0, 1),
        "expert_ffn": (spec.moe_ffn or 0, 1),
    }[dim]


def conditions(spec: ModelSpec, pp: int = 1) -> set[str]:
    out = {
        "tied" if spec.tied_embeddings else "untied",
        "lm_head" if spec.num_labels is None else "score_head",
    }
    if spec.qkv_bias:
        out.add("qkv_bias")
    if spec.qk_norm:
        out.add("qk_norm")
    out.add("moe" if spec.is_moe else "dense_mlp")
    if pp > 1:
        out.add("pp>1")
    return out


def _rows(spec: ModelSpec, pp: int) -> list[Row]:
    active = conditions(spec, pp)
    return [row for row in family_table(spec.family) if set(row.when) <= active]


def _hf_shape(spec: ModelSpec, shape: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(n * unit for n, unit in (dim_size(spec, d) for d in shape))


def _padded(spec: ModelSpec, tp: int, rule: str | None) -> int:
    """Padded vocabulary size under a side's rule."""
    if rule == "megatron":
        padded = spec.mcore_padded_vocab(tp)
    elif rule == "vllm":
        padded = -(-spec.vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    else:
        return spec.vocab
    if padded % tp:
        raise LayoutError(f"padded vocab {padded} is not divisible by TP={tp}")
    return padded


def _unit_range(n: int, tp: int, rank: int, side: Side, what: str) -> tuple[int, int]:
    """Units of a part that TP rank `rank` holds."""
    if n % tp == 0:
        per = n // tp
        return rank * per, (rank + 1) * per
    if side.replicate_short and n < tp and tp % n == 0:
        unit = rank // (tp // n)
        return unit, unit + 1
    raise LayoutError(
        f"{what}: {n} units are not divisible by TP={tp}"
        + ("" if side.replicate_short else " (this side cannot replicate them)")
    )


def _tp_pieces(
    spec: ModelSpec, row: Row, side: Side, name: str, hf_names: tuple[str, ...], tp: int, rank: int
) -> LocalTensor:
    """The local tensor of one row on TP rank `rank`, as pieces of the HF tensors."""
    shapes = [_hf_shape(spec, s) for s in row.shapes]
    if side.split_dim is None:
        if len(hf_names) != 1:
            raise LayoutError(f"{name}: a replicated tensor cannot fuse {len(hf_names)} parts")
        full = tuple((0, s) for s in shapes[0])
        return LocalTensor(name, shapes[0], (Piece(full, hf_names[0], full),))
    d = side.split_dim
    runs = _split_runs(spec, row, side, name, tp, rank)  # [(part, start, stop)] along d
    pieces, offset = [], 0
    for part, start, stop in runs:
        hf_box = tuple((start, stop) if i == d else (0, s) for i, s in enumerate(shapes[part]))
        local_box = tuple(
            (offset, offset + stop - start) if i == d else (0, s)
            for i, s in enumerate(shapes[part])
        )
        pieces.append(Piece(local_box, hf_names[part], hf_box))
        offset += stop - start
    if side.pad_vocab:
        offset = _padded(spec, tp, side.pad_vocab) // tp
    shape = tuple(offset if i == d else s for i, s in enumerate(shapes[0]))
    return LocalTensor(name, shape, tuple(pieces))


def _split_runs(
    spec: ModelSpec, row: Row, side: Side, name: str, tp: int, rank: int
) -> list[tuple[int, int, int]]:
    """Element ranges (part, start, stop) along the split dim, in local order."""
    d = side.split_dim
    assert d is not None  # `_tp_pieces` keeps an unsplit tensor whole
    units = [dim_size(spec, shape[d]) for shape in row.shapes]
    if side.pad_vocab:
        ((n, _),) = units
        per = _padded(spec, tp, side.pad_vocab) // tp
        start, stop = rank * per, min((rank + 1) * per, n)
        return [(0, start, stop)] if start < stop else []
    if side.interleave is None:
        runs = []
        for part, (n, size) in enumerate(units):
            u0, u1 = _unit_range(n, tp, rank, side, f"{name} part {row.hf[part]}")
            runs.append((part, u0 * size, u1 * size))
        return runs
    groups, _ = dim_size(spec, side.interleave)
    g0, g1 = _unit_range(groups, tp, rank, Side(name), f"{name} ({side.interleave})")
    runs = []
    for group in range(g0, g1):
        for part, (n, size) in enumerate(units):
            per_group = n // groups
            runs.append((part, group * per_group * size, (group + 1) * per_group * size))
    return runs


def megatron_shards(
    spec: ModelSpec, parallel: ParallelConfig, *, layer_spec: LayerSpec = "local"
) -> ShardMap:
    """Every training rank's Megatron parameters as pieces of HF tensors.

    Keys are `GPTModel` state-dict names under megatron-core's `layer_spec` ("local" or "te",
    `Side.megatron_name`) with the layer index local to the pipeline chunk, prefixed `model{v}.`
    per VPP chunk when `parallel.vpp` is set. DP replicas hold the same pieces. Embedding on
    stage 0 chunk 0; final norm and output layer on the last stage's last chunk.

    Parameters only: the `_extra_state` entries a module's state dict also has (see
    `extra_state_modules`) hold no weights — loading takes them from the module itself
    (`models.gpt.load_chunks`) and the weight sync never sends them.
    """
    try:
        check_layer_spec(layer_spec)
    except ValueError as err:
        raise LayoutError(str(err)) from None
    validate_megatron_grid(spec, parallel)
    rows = _rows(spec, parallel.pp)
    layer_ranges = parallel.layer_ranges(spec.layers)
    last_chunk = (parallel.vpp or 1) - 1
    smap = ShardMap("megatron", spec.family, _hf_shapes(spec, rows))
    per_tp: dict[tuple[int, int, int, int], dict[str, LocalTensor]] = {}
    for rank in range(parallel.world_size):
        c = parallel.coords_of(rank)
        ec = parallel.expert_coords_of(rank)
        smap.rank_labels[rank] = f"tp{c['tp']} pp{c['pp']} dp{c['dp']}" + (
            f" ep{ec['ep']} etp{ec['etp']}" if spec.is_moe else ""
        )
        key = (c["tp"], c["pp"], ec["ep"], ec["etp"])
        if key not in per_tp:  # DP replicas (and expert-DP replicas) share one expansion
            tensors: dict[str, LocalTensor] = {}
            for (pp, chunk), layers in layer_ranges.items():
                if pp != c["pp"]:
                    continue
                prefix = f"model{chunk}." if parallel.vpp else ""
                for row in rows:
                    side = row.mcore
                    if side is None or not _on_chunk(row, pp, chunk, parallel, last_chunk):
                        continue
                    name = side.megatron_name(layer_spec)
                    if row.per_expert:
                        for moe_layer in layers:
                            tensors.update(
                                _expert_tensors(
                                    spec,
                                    row,
                                    side,
                                    prefix + name,
                                    moe_layer,
                                    moe_layer - layers.start,
                                    _expert_range(spec, parallel.ep, ec["ep"]),
                                    parallel.expert_tp,
                                    ec["etp"],
                                )
                            )
                        continue
                    places: Iterable[int | None] = layers if row.place == "layer" else [None]
                    for layer in places:
                        local_name = prefix + name.format(
                            layer=layer - layers.start if layer is not None else None
                        )
                        hf_names = tuple(h.format(layer=layer) for h in row.hf)
                        tensors[local_name] = _tp_pieces(
                            spec, row, side, local_name, hf_names, parallel.tp, c["tp"]
                        )
            per_tp[key] = tensors
        smap.ranks[rank] = per_tp[key]
    return smap


def extra_state_modules(spec: ModelSpec, layer_spec: LayerSpec = "local") -> list[str]:
    """The decoder-layer modules ('decoder.layers.{layer}.<module>') whose `_extra_state` a dist
    checkpoint stores as a ShardedObject under either layer spec: the modules of the layer rows
    that are split over TP — megatron's Column/RowParallelLinear (local spec; state None) and
    TE's linears (TE spec; fp8 metadata). Norms and attention store none there. (A TE model's
    plain `state_dict()` has more `_extra_state` entries — core attention, and norms in newer
    TE — which loading takes from the module itself.)"""
    check_layer_spec(layer_spec)
    modules = []
    for row in _rows(spec, 1):
        if row.place == "layer" and row.mcore is not None and row.mcore.split_dim is not None:
            modules.append(row.mcore.megatron_name(layer_spec).rsplit(".", 1)[0])
    return list(dict.fromkeys(modules))


def _expert_range(spec: ModelSpec, ep: int, ep_rank: int) -> range:
    """Global experts held by expert-parallel rank `ep_rank` of `ep`."""
    per = spec.routed_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def _expert_tensors(
    spec: ModelSpec,
    row: Row,
    side: Side,
    name: str,
    hf_layer: int,
    local_layer: int,
    experts: range,
    tp: int,
    tp_rank: int,
) -> dict[str, LocalTensor]:
    """A per-expert row's local tensors on one rank: each expert of `experts` split over the
    side's expert-TP (`tp`, `tp_rank`); one tensor per expert (named by local index) or, with
    `stack_experts`, one tensor stacking them on a new leading dim."""
    per_expert = []
    for j, expert in enumerate(experts):
        key = name.format(layer=local_layer, expert=j)
        hf_names = tuple(h.format(layer=hf_layer, expert=expert) for h in row.hf)
        per_expert.append(_tp_pieces(spec, row, side, key, hf_names, tp, tp_rank))
    if not side.stack_experts:
        return {t.key: t for t in per_expert}
    key = name.format(layer=local_layer)
    pieces = tuple(
        Piece(((j, j + 1), *p.local_box), p.hf_name, p.hf_box)
        for j, t in enumerate(per_expert)
        for p in t.pieces
    )
    return {key: LocalTensor(key, (len(per_expert), *per_expert[0].shape), pieces)}


def _on_chunk(row: Row, pp: int, chunk: int, parallel: ParallelConfig, last_chunk: int) -> bool:
    if row.place == "layer":
        return True
    if row.place == "first":
        return pp == 0 and chunk == 0
    return pp == parallel.pp - 1 and chunk == last_chunk


def vllm_shards(
    spec: ModelSpec, tp: int, engines: int = 1, *, expert_parallel: bool = False
) -> ShardMap:
    """Every vLLM worker's parameters: rank `engine * tp + tp_rank`, keys = vLLM names.

    expert_parallel: vLLM's `enable_expert_parallel` — TP rank r of each engine holds the whole
    experts `vllm_local_experts(num_experts, tp, r)`, stacked in local order, instead of a
    1/tp slice of every expert; the dense tensors are split over TP as without it.
    """
    if tp < 1 or engines < 1:
        raise LayoutError(f"vLLM tp={tp}, engines={engines}: both must be >= 1")
    if expert_parallel:
        check_vllm_expert_parallel(spec, tp)
    if spec.heads % tp:
        raise LayoutError(f"vLLM tp={tp} does not divide num_attention_heads={spec.heads}")
    if spec.kv_heads % tp and tp % spec.kv_heads:
        raise LayoutError(
            f"vLLM tp={tp} neither divides nor is a multiple of num_key_value_heads={spec.kv_heads}"
        )
    rows = [row for row in _rows(spec, 1) if row.vllm is not None]
    smap = ShardMap("vllm", spec.family, _hf_shapes(spec, rows))
    for tp_rank in range(tp):
        tensors: dict[str, LocalTensor] = {}
        for row in rows:
            side = row.vllm
            assert side is not None  # `rows` keeps the rows vLLM has
            if row.per_expert:  # TP: every expert, each split over TP; EP: whole experts
                experts, expert_tp, expert_tp_rank = (
                    (vllm_local_experts(spec.routed_experts, tp, tp_rank), 1, 0)
                    if expert_parallel
                    else (_expert_range(spec, 1, 0), tp, tp_rank)
                )
                for moe_layer in range(spec.layers):
                    tensors.update(
                        _expert_tensors(
                            spec,
                            row,
                            side,
                            side.name,
                            moe_layer,
                            moe_layer,
                            experts,
                            expert_tp,
                            expert_tp_rank,
                        )
                    )
                continue
            places: Iterable[int | None] = range(spec.layers) if row.place == "layer" else [None]
            for layer in places:
                name = side.name.format(layer=layer)
                hf_names = tuple(h.format(layer=layer) for h in row.hf)
                tensors[name] = _tp_pieces(spec, row, side, name, hf_names, tp, tp_rank)
        for engine in range(engines):
            smap.ranks[engine * tp + tp_rank] = tensors
            smap.rank_labels[engine * tp + tp_rank] = f"engine{engine} tp{tp_rank}" + (
                f" ep{tp_rank}" if expert_parallel else ""
            )
    return smap


def vllm_fp8_names(spec: ModelSpec) -> frozenset[str]:
    """The vLLM parameters its online FP8 methods quantize (the rows whose vLLM side is
    `fp8`), by name."""
    names: set[str] = set()
    for row in _rows(spec, 1):
        if row.vllm is not None and row.vllm.fp8:
            places: Iterable[int | None] = range(spec.layers) if row.place == "layer" else [None]
            names.update(row.vllm.name.format(layer=layer) for layer in places)
    return frozenset(names)


def check_vllm_expert_parallel(spec: ModelSpec, tp: int) -> None:
    """vLLM's EP places whole routed experts: a dense model has none, and every rank must get
    at least one (vLLM would build empty expert tensors)."""
    if not spec.is_moe:
        raise LayoutError(
            f"vLLM expert_parallel: {spec.architecture} has no routed experts "
            "(a dense model): nothing to place"
        )
    if spec.routed_experts < tp:
        raise LayoutError(
            f"vLLM expert_parallel at tp={tp}: {spec.routed_experts} experts leave "
            f"TP ranks {spec.routed_experts}..{tp - 1} without an expert"
        )


def hf_shards(spec: ModelSpec) -> ShardMap:
    """The HF checkpoint as a one-rank shard map: every HF tensor whole on rank 0."""
    rows = [row for row in _rows(spec, 1) if row.vllm is not None or row.mcore is not None]
    shapes = _hf_shapes(spec, rows)
    smap = ShardMap("hf", spec.family, shapes, rank_labels={0: "hf"})
    smap.ranks[0] = {}
    for name, shape in shapes.items():
        full = tuple((0, s) for s in shape)
        smap.ranks[0][name] = LocalTensor(name, shape, (Piece(full, name, full),))
    return smap


def _hf_shapes(spec: ModelSpec, rows: Iterable[Row]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for row in rows:
        experts: Iterable[int | None] = range(spec.routed_experts) if row.per_expert else [None]
        places: Iterable[int | None] = range(spec.layers) if row.place == "layer" else [None]
        for layer in places:
            for expert in experts:
                for hf, shape in zip(row.hf, row.shapes, strict=True):
                    shapes[hf.format(layer=layer, expert=expert)] = _hf_shape(spec, shape)
    return shapes


def validate_megatron_grid(spec: ModelSpec, parallel: ParallelConfig) -> None:
    """The grid check of `ParallelConfig.check_model`, as a LayoutError naming the field."""
    try:
        parallel.check_model(spec)
    except ConfigError as err:
        raise LayoutError(str(err.under("parallel"))) from None


def materialize_rank(
    smap: ShardMap,
    rank: int,
    hf_get: Callable[[str], torch.Tensor],
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Build rank `rank`'s local tensors from HF tensors (`hf_get(name)`; a safetensors
    `get_slice` works too). Padding is zeros."""
    out = {}
    for key, local in smap.ranks[rank].items():
        out[key] = _build_local(local, hf_get, dtype)
    return out


def _build_local(local, hf_get, dtype) -> torch.Tensor:
    tensor = None
    if not local.pieces:  # all padding (e.g. a vocab shard past the real vocabulary)
        return torch.zeros(local.shape, dtype=dtype or torch.float32)
    for piece in local.pieces:
        src = hf_get(piece.hf_name)[box_slices(piece.hf_box)]
        if tensor is None:
            tensor = torch.zeros(local.shape, dtype=dtype or src.dtype)
        tensor[box_slices(piece.local_box)] = src
    return tensor


def assemble_hf(
    smap: ShardMap,
    local_tensors: Mapping[int, Mapping[str, torch.Tensor]],
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Rebuild HF tensors from ranks' local tensors (any replica may supply a region).
    Raises LayoutError naming any HF tensor that is not fully covered."""
    wanted = set(names) if names is not None else set(smap.hf_shapes)
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for rank, tensors in local_tensors.items():
        for key, tensor in tensors.items():
            local = smap.ranks[rank][key]
            if tuple(tensor.shape) != local.shape:
                raise LayoutError(
                    f"{smap.label(rank)} tensor {key}: shape "
                    f"{tuple(tensor.shape)}, expected {local.shape}"
                )
            for piece in local.pieces:
                if piece.hf_name not in wanted:
                    continue
                if piece.hf_name not in out:
                    shape = smap.hf_shapes[piece.hf_name]
                    out[piece.hf_name] = torch.empty(shape, dtype=tensor.dtype)
                    covered[piece.hf_name] = torch.zeros(shape, dtype=torch.bool)
                out[piece.hf_name][box_slices(piece.hf_box)] = tensor[box_slices(piece.local_box)]
                covered[piece.hf_name][box_slices(piece.hf_box)] = True
    missing = sorted(wanted - set(out)) + sorted(n for n, c in covered.items() if not c.all())
    if missing:
        raise LayoutError(
            f"HF tensors not fully covered by the given shards: {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    return out
