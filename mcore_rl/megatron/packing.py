"""Sequence packing: this DP rank's padded rows → micro batches of at most a token budget.

The controller sends padded rows [n, s] (tokens, labels and every per-token tensor aligned with
the labels). A row's *valid length* is the non-pad prefix that matters: position t predicts
label t, so everything after the last loss-masked label (the last response token) is padding
whose outputs nobody reads, and under causal attention it changes none of the earlier outputs.
`valid_lengths` therefore takes the length from the mask (last nonzero + 1); without a mask a
row is kept whole.

Packing is first-fit-decreasing (rows sorted by length, longest first, ties by row index, each
placed into the first micro batch with room): deterministic, so every rank of a pipeline —
holding the same DP slice — computes the same plan. A packed micro batch is ONE row [1, T] with
its sequences concatenated; `segment_ids` [1, T] say which sequence each token belongs to (the
padding tail, if any, is one more segment with an all-zero mask).

Attention must not cross sequences. megatron-core's local-spec DotProductAttention takes an
explicit boolean mask (True = masked, `masked_fill(-10000)` in FusedScaleMaskSoftmax's torch
path) in place of its default causal one: `model_inputs` gives it the block-diagonal causal
mask [1, 1, T, T]. Position ids restart at 0 in each sequence; the rotary embedding ignores
them (GPTModel applies RoPE over the packed row's positions 0..T-1), but attention scores
under RoPE depend only on relative positions, so with the block-diagonal mask the outputs equal
the unpacked ones up to fp rounding. Measured on the `micro` preset (fp32, TP2 and PP2,
tests/megatron/test_packing.py): packed vs padded log-probs differ by <= 4.8e-7.
On GPU (TE spec) `model_inputs` gives THD instead: `PackedSeqParams(cu_seqlens)`, no T×T mask,
RoPE restarting per sequence (written, not yet run: no GPU here; its cu_seqlens are unit-tested,
and the mask path above is its CPU twin).

Pipeline parallelism sends fixed-shape activations [T, 1, hidden] between stages, so with
pp > 1 every micro batch of one call is padded to the longest (`common_length`); with
sequence parallelism T is a multiple of tp; interleaved (VPP) schedules need a multiple of pp
micro batches (filled with all-padding micro batches).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore_rl.parallel import ParallelConfig


@dataclass(frozen=True)
class PackPlan:
    """Which of this rank's rows form which packed micro batch.

    bins[i]: row indices packed into micro batch i, in the order they sit in the row (an empty
    bin is an all-padding filler). lengths[r]: tokens kept of row r. seq_len: s of the padded
    rows. row_lens[i]: T of micro batch i (its tokens plus padding at the end).
    """

    bins: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    seq_len: int
    row_lens: tuple[int, ...]

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def efficiency(self) -> float:
        """Real tokens / tokens the model runs on (1.0 = no padding waste)."""
        return self.real_tokens / max(sum(self.row_lens), 1)

    @property
    def padded_efficiency(self) -> float:
        """The same ratio for the unpacked [n, s] rows, for comparison."""
        return self.real_tokens / max(len(self.lengths) * self.seq_len, 1)


def valid_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Per row of `mask` [n, s]: index of the last nonzero + 1 (at least 1, so that every row
    keeps a token and every micro batch is non-empty)."""
    if mask.dim() != 2:
        raise ValueError(f"mask: expected [n, s], got shape {tuple(mask.shape)}")
    s = mask.shape[1]
    positions = torch.arange(1, s + 1, device=mask.device).expand_as(mask)
    return torch.where(mask != 0, positions, 0).amax(dim=1).clamp(min=1)


def plan_packing(lengths: list[int] | torch.Tensor, max_tokens: int, *, seq_len: int,
                 multiple: int = 1, common_length: bool = False,
                 bins_multiple: int = 1) -> PackPlan:
    """First-fit-decreasing packing of rows with `lengths` into bins of <= max_tokens tokens.

    multiple: each bin's T is rounded up to it (sequence parallel: tp). common_length: all bins
    padded to the longest (pipeline parallel). bins_multiple: the number of bins is rounded up
    (interleaved pipeline: pp). When every bin pays the longest's length (common_length) or
    the count was rounded up, the rows are re-spread over that many bins longest-first onto the
    least-loaded bin, which shortens the longest bin instead of adding all-padding fillers;
    fillers remain only where that would break the budget.
    """
    lengths = [int(x) for x in lengths]
    for row, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"row {row}: {length} valid tokens exceed "
                             f"max_tokens_per_micro_batch={max_tokens}")
        if not 0 < length <= seq_len:
            raise ValueError(f"lengths[{row}]={length}: expected 1..seq_len={seq_len}")
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    bins: list[list[int]] = []
    used: list[int] = []
    for row in order:
        for i, total in enumerate(used):
            if total + lengths[row] <= max_tokens:
                bins[i].append(row)
                used[i] += lengths[row]
                break
        else:
            bins.append([row])
            used.append(lengths[row])
    count = -(-len(bins) // bins_multiple) * bins_multiple
    if common_length or count > len(bins):
        bins, used = _balanced(bins, used, order, lengths, count, max_tokens)
    row_lens = [-(-max(u, 1) // multiple) * multiple for u in used]
    if common_length:
        row_lens = [max(row_lens)] * len(row_lens)
    return PackPlan(bins=tuple(tuple(b) for b in bins), lengths=tuple(lengths),
                    seq_len=seq_len, row_lens=tuple(row_lens))


def _balanced(bins, used, order, lengths, count, max_tokens):
    """Rows spread over `count` bins, each onto the least-loaded (lowest index on ties); the
    first-fit bins padded with empty fillers if that is not shorter or breaks the budget."""
    spread: list[list[int]] = [[] for _ in range(count)]
    load = [0] * count
    for row in order:
        i = min(range(count), key=lambda b: (load[b], b))
        spread[i].append(row)
        load[i] += lengths[row]
    if max(load) <= min(max(used), max_tokens):
        return spread, load
    fill = count - len(bins)
    return bins + [[] for _ in range(fill)], used + [0] * fill


def plan_for_grid(lengths: list[int] | torch.Tensor, max_tokens: int, *, seq_len: int,
                  parallel: ParallelConfig) -> PackPlan:
    """`plan_packing` with the shape constraints of the training grid (see module docstring)."""
    return plan_packing(lengths, max_tokens, seq_len=seq_len,
                        multiple=parallel.tp if parallel.sequence_parallel else 1,
                        common_length=parallel.pp > 1,
                        bins_multiple=parallel.pp if parallel.vpp else 1)


def forward_micro_rows(rows: int, *, micro_batch_size: int, forward_micro_batch_size: int | None,
                       parallel: ParallelConfig) -> int:
    """Rows per fixed micro batch of a forward-only pass over `rows` (this DP rank's share):
    `forward_micro_batch_size` (capped at `rows`) when it splits the rows evenly — into a
    multiple of pp micro batches under interleaved pipelining — else `micro_batch_size`."""
    if forward_micro_batch_size is None:
        return micro_batch_size
    size = min(forward_micro_batch_size, rows)
    if size < 1 or rows % size:
        return micro_batch_size
    if parallel.vpp is not None and (rows // size) % parallel.pp:
        return micro_batch_size
    return size


def pack(tensors: dict[str, torch.Tensor], plan: PackPlan) -> list[dict]:
    """Rows [n, s] → one dict per bin of [1, T] tensors (zeros after the last sequence) plus
    "segment_ids" [1, T] (sequence k of the bin → k; the padding tail → len(bin)) and
    "segment_lengths", the segments' token counts as host integers (the tail's when it has
    any): what the model inputs and per-sequence views take, so that no micro batch reads
    its lengths back from the device."""
    n = len(plan.lengths)
    for name, t in tensors.items():
        if t.shape[:2] != (n, plan.seq_len):
            raise ValueError(f"{name}: expected [{n}, {plan.seq_len}], got {tuple(t.shape)}")
    # segment ids live with the tensors they describe (the model's device, see ActorWorker._micro)
    device = next(iter(tensors.values())).device if tensors else None
    out = []
    for rows, row_len in zip(plan.bins, plan.row_lens):
        seg = [torch.full((plan.lengths[r],), k, dtype=torch.long, device=device)
               for k, r in enumerate(rows)]
        used = sum(plan.lengths[r] for r in rows)
        seg.append(torch.full((row_len - used,), len(rows), dtype=torch.long, device=device))
        tail = row_len - used
        packed = {"segment_ids": torch.cat(seg).unsqueeze(0),
                  "segment_lengths": tuple(plan.lengths[r] for r in rows) + ((tail,) if tail
                                                                             else ())}
        for name, t in tensors.items():
            parts = [t[r, :plan.lengths[r]] for r in rows]
            parts.append(t.new_zeros((row_len - used, *t.shape[2:])))
            packed[name] = torch.cat(parts).unsqueeze(0)
        out.append(packed)
    return out


def unpack(outputs: list[torch.Tensor], plan: PackPlan) -> torch.Tensor:
    """Per-token outputs of the packed micro batches ([1, T] or [T] each, or [1, T, ...] with
    per-token trailing dims) → [n, s, ...] in the original row order, zeros on padding."""
    if len(outputs) != len(plan.bins):
        raise ValueError(f"outputs: {len(outputs)} micro batches, the plan has {len(plan.bins)}")
    trailing = tuple(outputs[0].shape[2:]) if outputs[0].dim() > 2 else ()
    result = outputs[0].new_zeros((len(plan.lengths), plan.seq_len, *trailing))
    for i, (rows, out) in enumerate(zip(plan.bins, outputs)):
        out = out.reshape(-1, *trailing)
        if out.shape[0] != plan.row_lens[i]:
            raise ValueError(f"outputs[{i}]: {out.shape[0]} tokens, expected {plan.row_lens[i]}")
        start = 0
        for r in rows:
            result[r, :plan.lengths[r]] = out[start:start + plan.lengths[r]]
            start += plan.lengths[r]
    return result


# --- model inputs of a micro batch ------------------------------------------------------------


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[1, T] segment ids → bool [1, 1, T, T], True where query i must not see key j (j > i or
    another sequence): megatron's attention_mask convention."""
    seg = segment_ids[0]
    t = seg.shape[0]
    future = torch.ones(t, t, dtype=torch.bool, device=seg.device).triu(diagonal=1)
    return (future | (seg.unsqueeze(1) != seg.unsqueeze(0)))[None, None]


def segment_positions(segment_ids: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """[1, T] → position of each token inside its sequence, [1, T] (restarting at 0);
    `lengths`: the segments' token counts (`pack`'s host integers)."""
    seg = segment_ids[0]
    counts = host_ints_on(lengths, seg.device)
    starts = torch.cumsum(counts, 0) - counts
    return (torch.arange(seg.shape[0], device=seg.device) - starts[seg]).unsqueeze(0)


def host_ints_on(values: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """Host integers as an int64 tensor on `device` without waiting on it: a GPU gets them
    by an asynchronous copy from pinned memory (a pageable copy would synchronize)."""
    out = torch.tensor(values, dtype=torch.int64)
    if torch.device(device).type == "cuda":
        return out.pin_memory().to(device, non_blocking=True)
    return out.to(device)


def model_inputs(batch, config) -> dict:
    """GPTModel.forward keyword arguments for a micro batch
    (`chunk(**model_inputs(batch, chunk.config))`; `config` is the chunk's TransformerConfig,
    whose `transformer_impl` says which layer spec built it — models.gpt).

    Unpacked ([b, s], `segment_ids` None): positions 0..s-1 and no mask (the attention builds
    the causal one). Packed ([1, T]) with the local spec: per-sequence positions and the
    block-diagonal causal mask. Packed with the TransformerEngine spec: THD — no mask,
    `PackedSeqParams` with the segments' cumulative lengths, so TE's attention and RoPE treat
    each sequence on its own. The one place every forward step takes its model inputs from.
    """
    tokens = batch.tokens
    segment_ids = getattr(batch, "segment_ids", None)
    if segment_ids is None:
        b, s = tokens.shape
        return {"input_ids": tokens,
                "position_ids": torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s),
                "attention_mask": None}
    lengths = batch.segment_lengths
    positions = segment_positions(segment_ids, lengths)
    if config.transformer_impl != "transformer_engine":  # the local spec
        return {"input_ids": tokens, "position_ids": positions,
                "attention_mask": block_causal_mask(segment_ids)}
    return {"input_ids": tokens, "position_ids": positions, "attention_mask": None,
            "packed_seq_params": thd_params(lengths, tokens.device)}


def thd_params(lengths: tuple[int, ...], device: torch.device | str):
    """megatron's PackedSeqParams for one packed row of segments with token counts `lengths`
    (`pack`'s host integers, the padding tail one more segment): cu_seqlens = [0, cumsum]
    (int32, on `device`) and the longest segment, both from the host.
    Runs only on GPU (TE spec); its CPU twin is the block-diagonal mask path, tested against
    padded micro batches."""
    from megatron.core.packed_seq_params import PackedSeqParams  # lazy: megatron

    bounds = tuple(itertools.accumulate(lengths, initial=0))
    cu_seqlens = host_ints_on(bounds, device).to(torch.int32)
    longest = max(lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def per_sequence(x: torch.Tensor, segment_ids: torch.Tensor | None,
                 lengths: tuple[int, ...] | None = None) -> torch.Tensor:
    """A per-token tensor of a micro batch → one row per sequence, [k, L_max], zeros after
    each sequence's end (differentiable). Unpacked batches (`segment_ids` None) already are;
    a packed one's `lengths` are `pack`'s host segment lengths."""
    return per_sequence_view(segment_ids, lengths, x.device)(x)


def per_sequence_view(segment_ids: torch.Tensor | None, lengths: tuple[int, ...] | None,
                      device: torch.device | str) -> Callable[[torch.Tensor], torch.Tensor]:
    """`per_sequence` for every per-token tensor of one micro batch (on `device`): the
    segments' counts reach the device once, not once per tensor."""
    if segment_ids is None:
        return lambda x: x
    if lengths is None:
        raise ValueError("per_sequence: a packed micro batch needs its segment lengths "
                         "(packing.pack's segment_lengths)")
    counts, longest = host_ints_on(lengths, device), max(lengths)
    return lambda x: sequence_rows(x, counts, longest)


def sequence_rows(x: torch.Tensor, counts: torch.Tensor, longest: int) -> torch.Tensor:
    """`per_sequence` given the segments' token counts [k] (on x's device) and the longest
    count: [1, T] → [k, longest], zeros after each sequence's end."""
    starts = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(longest, device=x.device)
    valid = offsets.unsqueeze(0) < counts.unsqueeze(1)
    index = torch.where(valid, starts.unsqueeze(1) + offsets.unsqueeze(0), 0)
    return torch.where(valid, x[0][index], x.new_zeros(()))


def response_window(mask: torch.Tensor) -> tuple[int, int] | None:
    """[lo, hi): the first and one past the last label position where any row of `mask`
    ([b, s], on the host: no device sync) is nonzero; None when none is. The policy update
    computes logits there only (`policy.PolicyBatch.logit_window`)."""
    columns = mask.ne(0).any(0).nonzero()
    if not len(columns):
        return None
    return int(columns[0]), int(columns[-1]) + 1

