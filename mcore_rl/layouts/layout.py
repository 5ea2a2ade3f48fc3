"""The vocabulary of parameter layouts: declarative per-side specs, and the shard maps they
expand to.

A model family is a table of `Row`s (see `families.py`). Each row names one HF tensor (or
several HF tensors fused into one, like q/k/v) and says, per side (Megatron, vLLM), what the
per-rank tensor looks like: which tensor dim is split over TP, whether fused parts interleave
per query group, whether the vocabulary is padded, whether too-few kv heads are replicated.
`shards.py` expands a table into a `ShardMap`: for every rank, every local tensor as a list of
`Piece`s — boxes of the local tensor and the HF-tensor boxes they hold. Planning, conversion and
checks all work on those boxes; nothing anywhere copies tensors by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Literal

from mcore_rl.models.spec import LayerSpec, check_layer_spec, grouped_expert_gemm

# A box is a half-open range per tensor dim: ((start0, stop0), (start1, stop1), ...).
Box = tuple[tuple[int, int], ...]

# Symbolic dimension names used in HF shapes; sizes come from ModelSpec (see shards.dim_size).
Dim = Literal[
    "hidden", "ffn", "vocab", "heads", "kv_heads", "labels", "head_dim", "experts", "expert_ffn"
]


@dataclass(frozen=True)
class Side:
    """How one side (Megatron or vLLM) holds a row's tensor on each TP rank.

    name: the side's parameter name; `{layer}` is the layer index (Megatron: local to its
        pipeline chunk; vLLM: global). For Megatron, the local layer spec's name.
    te_fused_into: Megatron only — the TransformerEngine layer spec has no module of its own
        for this norm: it fuses it into the following linear (TE's LayerNormLinear), whose
        parameter `layer_norm_<param>` holds it. The module path of that linear, e.g.
        "decoder.layers.{layer}.self_attention.linear_qkv" (see `megatron_name`).
    split_dim: tensor dim split over the TP axis; None = every TP rank holds the whole tensor.
    interleave: fused parts interleave per group of this symbol ("kv_heads": Megatron's
        linear_qkv holds, per query group, that group's q heads, then its k head, then its v
        head); None = parts are concatenated whole per rank ([q_r; k_r; v_r], [gate_r; up_r]).
    replicate_short: when a part has fewer units than TP ranks, rank r holds unit
        r // (tp / units) (vLLM's kv-head replication); otherwise TP must divide the units.
    pad_vocab: pad the split dim before splitting: "megatron" (to a multiple of 128·TP) or
        "vllm" (to a multiple of 64, then split evenly); padding rows are zeros.
    fp8: vLLM only — vLLM's online FP8 methods (`fp8_per_tensor`, `fp8_per_block`) quantize
        this tensor: the weight of a linear layer (`LinearBase`, the MoE router included) or of
        the routed experts; embeddings, the LM head, norms and biases stay in the model dtype.
    grouped_name: Megatron only, per-expert rows — the name of local expert `{expert}`'s
        tensor where the layer spec runs the experts as one grouped GEMM (TEGroupedMLP: the
        grouped linear holds expert j as `weight<j>`, same shape as SequentialMLP's
        per-expert weight; see `models.spec.grouped_expert_gemm`).
    stack_experts: (per-expert rows) the side holds all of its rank's experts in one tensor,
        stacked on a new leading dim in expert order (vLLM FusedMoE w13/w2); otherwise one
        tensor per expert, `{expert}` in `name` = the rank-local expert index. `split_dim`
        then counts the dims of one expert's tensor.
    """

    name: str
    te_fused_into: str | None = None
    split_dim: int | None = None
    interleave: Dim | None = None
    replicate_short: bool = False
    pad_vocab: Literal["megatron", "vllm"] | None = None
    stack_experts: bool = False
    grouped_name: str | None = None
    fp8: bool = False

    def megatron_name(self, layer_spec: LayerSpec) -> str:
        """The parameter name under megatron-core's `layer_spec` ("local" or "te").

        "te": a fused norm's `<module>.<param>` becomes `<te_fused_into>.layer_norm_<param>`
        (`input_layernorm.weight` → `self_attention.linear_qkv.layer_norm_weight`) — the same
        renaming megatron-core 0.16.1's local spec declares for its dist checkpoints
        (`sharded_state_dict_keys_map` in gpt_layer_specs.get_gpt_layer_local_spec); a routed
        expert's tensor becomes its `grouped_name` (TEGroupedMLP's grouped GEMM).
        """
        check_layer_spec(layer_spec)
        if self.grouped_name is not None and grouped_expert_gemm(layer_spec):
            return self.grouped_name
        if layer_spec == "te" and self.te_fused_into is not None:
            return f"{self.te_fused_into}.layer_norm_{self.name.rsplit('.', 1)[1]}"
        return self.name


@dataclass(frozen=True)
class Row:
    """One tensor family.

    hf: HF tensor names fused (in this order) into the side's single tensor.
    shapes: symbolic HF shape of each part, e.g. ("heads", "hidden") for q_proj.weight.
    mcore / vllm: the two sides' layouts (None: the side has no such tensor).
    place: where Megatron keeps it: in every decoder layer, on the first pipeline stage
        (embedding) or on the last (final norm, output layer).
    when: conditions that must all hold for the row to exist (see shards.conditions).
    per_expert: the row repeats for every routed expert of a layer: `{expert}` in the HF names
        is the global expert index; each side splits the experts over its expert-parallel axis
        (EP) and each expert's tensor over its expert-TP axis.
    """

    hf: tuple[str, ...]
    shapes: tuple[tuple[Dim, ...], ...]
    mcore: Side | None
    vllm: Side | None
    place: Literal["layer", "first", "last"] = "layer"
    when: tuple[str, ...] = ()
    per_expert: bool = False


@dataclass(frozen=True)
class Piece:
    """`local[local_box]` holds `hf_tensor(hf_name)[hf_box]` (same orientation, same extent).
    A stacked expert tensor's box has one more (leading, extent-1) dim than the HF box: the
    expert's slot on the stacking dim."""

    local_box: Box
    hf_name: str
    hf_box: Box


@dataclass(frozen=True)
class LocalTensor:
    """A tensor one rank holds. Elements no piece covers are padding (zeros)."""

    key: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclass
class ShardMap:
    """Every rank's local tensors on one side. `ranks[r][key]` is rank r's tensor `key`.

    side: "megatron", "vllm" or "hf". hf_shapes: the full HF shape of every HF tensor the
    side's pieces refer to. `rank_labels` names ranks in error messages (e.g. "tp1 pp0 dp0").
    """

    side: str
    family: str
    hf_shapes: dict[str, tuple[int, ...]]
    ranks: dict[int, dict[str, LocalTensor]] = field(default_factory=dict)
    rank_labels: dict[int, str] = field(default_factory=dict)

    def label(self, rank: int) -> str:
        return f"{self.side} rank {rank} ({self.rank_labels.get(rank, '?')})"

    def nbytes(self, rank: int, element_size: int) -> int:
        return sum(_numel(t.shape) for t in self.ranks[rank].values()) * element_size


def box_numel(box: Box) -> int:
    n = 1  # a loop, not prod() over a generator: the planner calls this per region
    for start, stop in box:
        n *= stop - start
    return n


def _numel(shape: tuple[int, ...]) -> int:
    return prod(shape)


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        start, stop = (a0 if a0 > b0 else b0), (a1 if a1 < b1 else b1)
        if start >= stop:  # empty along this dim: no need to look at the others
            return None
        out.append((start, stop))
    return tuple(out)


def translate(inner: Box, frm: Box, to: Box) -> Box:
    """The box in `to`'s coordinates that corresponds to `inner` (a sub-box of `frm`). Leading
    dims `to` has beyond `frm` (a stacked expert's slot) are kept as they are."""
    lead = len(to) - len(frm)
    pairs = zip(inner, frm, to[lead:], strict=True)
    return tuple(to[:lead]) + tuple(
        (t0 + i0 - f0, t0 + i1 - f0) for (i0, i1), (f0, _), (t0, _) in pairs
    )
