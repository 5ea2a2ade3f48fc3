"""Pure resharding planner: two shard maps in, point-to-point transfers out.

`build_plan(src, dst)` intersects every destination piece with the source pieces of the same
HF tensor. Source replicas (DP copies, TP-replicated norms, the tied output-layer copy) hold
identical regions; each region is taken from a replica on the destination's own device when one
holds it (`devices`: colocated, a copy within one GPU), else on its own node (`nodes`: a
same-node pair can use CUDA IPC / NVLink, a cross-node one only the network); a sharded region
from the least-loaded of its (DP) replicas so sends spread over them; a region more ranks
replicate (TP-replicated norms) from a source already sending to that destination — the
matching TP rank —, which adds no sender/receiver pair; each destination rank gets each region
once — so a training rank never sends the same bytes to one engine twice. Transfers are cut to
fit buckets and packed into rounds in which no rank sends or receives more than
`bucket_bytes`: that bounds every rank's staging memory. No process group, no tensors: a 70B
plan needs only shapes, and every rank builds the identical plan on its own (checked by
fingerprint before any byte moves).

Sync ranks: source rank s is sync rank s; destination rank d is sync rank `len(src) + d`.

Why not megatron.core.resharding: it reshards Megatron → Megatron (same names, same layouts)
inside one world, posts the whole plan as one batch (every receive buffer at once) and
barriers on the default group. We need Megatron → vLLM layouts (per-rank [q; k; v], vLLM
vocab padding, kv-head replication) across two worlds joined by a separate sync group, with
bounded buckets.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from mcore_rl.layouts.layout import Box, ShardMap, box_numel, intersect, translate


class PlanError(ValueError):
    """The two layouts cannot be connected (names the tensor and what is wrong)."""


@dataclass(frozen=True)
class Transfer:
    """Copy `src[src_box]` on sync rank `src_rank` to `dst[dst_box]` on sync rank `dst_rank`."""

    src_rank: int
    src_key: str
    src_box: Box
    dst_rank: int
    dst_key: str
    dst_box: Box

    @cached_property  # read by the planner, the packer and every byte count, per transfer
    def numel(self) -> int:
        return box_numel(self.src_box)


@dataclass(frozen=True)
class Fp8Units:
    """FP8 engines in a plan, as data (`resharding/fp8.per_tensor_units` and `per_block_units`
    decide it): which transfers the senders quantize, and each engine rank's scale parameters.

    Per tensor: transfer_unit[k][i] is round k's transfer i's logical tensor — the scale it
    shares — a position in one vector of `count` amaxes every sync rank all-reduces;
    scales[d][name]: the units whose scales destination sync rank d's scale parameter `name`
    holds, in order (one for a linear weight; one per local expert of a stacked tensor).
    Block-wise (count 0, no all-reduce): transfer_unit[k][i] numbers the transfers the senders
    quantize (each sends its blocks' scales too); an FP8 tensor's other transfers arrive in
    the engines' dtype and its engine rank quantizes it; scales is empty.
    Either way -1 marks a transfer that crosses unquantized, and scale_shapes[d][name] is the
    shape of every scale parameter the sync sets on destination sync rank d.
    """

    scheme: str
    count: int
    transfer_unit: tuple[tuple[int, ...], ...]
    scales: dict[int, dict[str, tuple[int, ...]]]
    scale_shapes: dict[int, dict[str, tuple[int, ...]]]


@dataclass
class Plan:
    """Transfers grouped into rounds. `rounds[k]` lists round k's transfers in a fixed order;
    within a round, one message per (src, dst) pair carries that pair's transfers in order.

    dst_shapes[d][key]: what destination sync rank d allocates (its own shard; padding zero).
    element_size: bytes per element of the transferred dtype.
    fp8: the engines hold FP8 weights (`Fp8Units`); None: every tensor as it is.
    """

    rounds: list[list[Transfer]]
    dst_shapes: dict[int, dict[str, tuple[int, ...]]]
    num_src: int
    num_dst: int
    element_size: int
    bucket_bytes: int
    src_labels: dict[int, str] = field(default_factory=dict)
    dst_labels: dict[int, str] = field(default_factory=dict)
    fp8: Fp8Units | None = None

    @property
    def world_size(self) -> int:
        return self.num_src + self.num_dst

    def label(self, sync_rank: int) -> str:
        if sync_rank < self.num_src:
            return f"training rank {sync_rank} ({self.src_labels.get(sync_rank, '?')})"
        return f"inference rank {sync_rank - self.num_src} ({self.dst_labels.get(sync_rank, '?')})"

    def expected_names(self, sync_rank: int) -> set[str]:
        """What destination rank `sync_rank` installs in a sync (`written`)."""
        return set(self.written(sync_rank))

    def written(self, sync_rank: int) -> dict[str, tuple[int, ...]]:
        """Every parameter a sync writes on destination rank `sync_rank`, with its shape: the
        tensors the transfers fill and, for FP8 engines, their scales."""
        out = dict(self.dst_shapes.get(sync_rank, {}))
        if self.fp8 is not None:
            out.update(self.fp8.scale_shapes.get(sync_rank, {}))
        return out

    def bytes_sent(self) -> dict[int, int]:
        return self._per_rank(lambda t: t.src_rank)

    def bytes_received(self) -> dict[int, int]:
        return self._per_rank(lambda t: t.dst_rank)

    def _per_rank(self, who) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for rnd in self.rounds:
            for t in rnd:
                out[who(t)] += t.numel * self.element_size
        return dict(out)

    def messages(self, round_index: int) -> dict[tuple[int, int], list[Transfer]]:
        """Round k's transfers grouped by (src, dst) pair, in plan order."""
        out: dict[tuple[int, int], list[Transfer]] = {}
        for t in self.rounds[round_index]:
            out.setdefault((t.src_rank, t.dst_rank), []).append(t)
        return out

    def fingerprint(self) -> bytes:
        """sha256 of the rounds and shapes; computed once per Plan object (plans are not
        edited after `build_plan`)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            cached = self.__dict__["_fingerprint"] = self._digest()
        return cached

    def __getstate__(self) -> dict:
        # a pickled plan never carries its fingerprint: the receiving rank recomputes it from
        # what it got, so `verify_plan` compares contents, not a copied label
        return {k: v for k, v in self.__dict__.items() if k != "_fingerprint"}

    def _digest(self) -> bytes:
        digest = hashlib.sha256()
        for k, rnd in enumerate(self.rounds):
            digest.update(
                repr(
                    (
                        k,
                        [
                            (t.src_rank, t.src_key, t.src_box, t.dst_rank, t.dst_key, t.dst_box)
                            for t in rnd
                        ],
                    )
                ).encode()
            )
        if self.fp8 is not None:
            digest.update(repr(self.fp8).encode())
        digest.update(
            repr(sorted((r, sorted(s.items())) for r, s in self.dst_shapes.items())).encode()
        )
        return digest.digest()


def build_plan(
    src: ShardMap,
    dst: ShardMap,
    *,
    bucket_bytes: int = 64 << 20,
    element_size: int = 4,
    nodes: Sequence[int] | None = None,
    devices: Sequence[int] | None = None,
) -> Plan:
    """Plan the transfers that give every destination rank exactly its pieces.

    nodes: the node of every sync rank (sources, then destinations: the resolved run's
    `sync_nodes()`); a region goes from a same-node replica when one holds it. None: one node.
    devices: the device of every sync rank on its node (`sync_devices()`: GPU runs); a region
    goes from a replica on the destination's own device before any other on its node. None:
    devices are not told apart.

    Raises PlanError if the families differ, an HF tensor's shape disagrees between the two
    sides, or a destination region is held by no source rank.
    """
    _check_compatible(src, dst)
    if bucket_bytes < element_size:
        raise PlanError(f"bucket_bytes={bucket_bytes} cannot hold one element")
    num_src = len(src.ranks)
    for name, given in (("nodes", nodes), ("devices", devices)):
        if given is not None and len(given) != num_src + len(dst.ranks):
            raise PlanError(
                f"{name} names {len(given)} sync ranks but the plan has "
                f"{num_src} + {len(dst.ranks)}"
            )
    place = _placement(nodes, devices)
    sources = _SourceIndex(src)
    load: dict[int, int] = defaultdict(int)
    transfers: list[Transfer] = []
    dst_shapes: dict[int, dict[str, tuple[int, ...]]] = {}
    for d in sorted(dst.ranks):
        sync_d = num_src + d
        dst_shapes[sync_d] = {key: local.shape for key, local in dst.ranks[d].items()}
        needs = _needs(sources, dst, d)
        transfers += _assign_sources(needs, sync_d, place, load, element_size)
    rounds = _pack_rounds(
        _split_to_fit(transfers, bucket_bytes, element_size), bucket_bytes, element_size
    )
    return Plan(
        rounds,
        dst_shapes,
        num_src,
        len(dst.ranks),
        element_size,
        bucket_bytes,
        src_labels=dict(src.rank_labels),
        dst_labels={num_src + r: lbl for r, lbl in dst.rank_labels.items()},
    )


def _needs(sources: _SourceIndex, dst: ShardMap, d: int) -> list[tuple]:
    """(key, piece, region, holders) of every region destination rank `d` receives."""
    needs = []
    for key, local in dst.ranks[d].items():
        for piece in local.pieces:
            needs += [
                (key, piece, region, holders)
                for region, holders in sources.regions(
                    piece.hf_name, piece.hf_box, key, dst.label(d)
                )
            ]
    return needs


def _assign_sources(
    needs: list[tuple], sync_d: int, place, load: dict[int, int], element_size: int
) -> list[Transfer]:
    """A source for each region sync rank `sync_d` needs. Sharded regions first (the fewest
    holders: one per DP replica), spread over their replicas by load (`load`, updated); then
    the regions more ranks replicate (norms over TP, the tied output layer) from a source that
    already sends to the destination — the matching TP rank — so replicated tensors open no
    extra sender/receiver pairs. Nearer sources (`place`) always come first."""
    fewest = min((len(n[3]) for n in needs), default=0)
    paired: set[int] = set()
    transfers = []
    for replicated in (False, True):
        for key, piece, region, holders in needs:
            if (len(holders) > fewest) != replicated:
                continue
            if len(holders) == 1:  # one holder: nothing to choose
                s, s_key, s_local_box, s_hf_box = holders[0]
            else:
                s, s_key, s_local_box, s_hf_box = min(
                    holders,
                    key=lambda h: (
                        place(h[0], sync_d),
                        replicated and h[0] not in paired,
                        load[h[0]],
                        h[0],
                    ),
                )
            load[s] += box_numel(region) * element_size
            paired.add(s)
            transfers.append(
                Transfer(
                    s,
                    s_key,
                    translate(region, s_hf_box, s_local_box),
                    sync_d,
                    key,
                    translate(region, piece.hf_box, piece.local_box),
                )
            )
    return transfers


def _placement(nodes: Sequence[int] | None, devices: Sequence[int] | None):
    """How far a source sync rank is from a destination: 0 the same device, 1 the same node,
    2 another node (what is not told counts as the same)."""

    def distance(s: int, d: int) -> int:
        if nodes is not None and nodes[s] != nodes[d]:
            return 2
        return int(devices is not None and devices[s] != devices[d])

    return distance


def _check_compatible(src: ShardMap, dst: ShardMap) -> None:
    if src.family != dst.family:
        raise PlanError(
            f"model families differ: source is {src.family!r}, destination is {dst.family!r}"
        )
    for name, shape in dst.hf_shapes.items():
        if name in src.hf_shapes and src.hf_shapes[name] != shape:
            raise PlanError(
                f"tensor {name}: source shape {src.hf_shapes[name]} but destination shape {shape}"
            )


class _SourceIndex:
    """The source pieces of every HF tensor, `pieces[hf_name]`: [(rank, key, local_box,
    hf_box)] over all source ranks. Tensors whose pieces lie on the same ranks at the same
    boxes (every expert of a layer, the same projection in every layer) share a geometry, so
    how a wanted box splits over their pieces is worked out once per geometry and box."""

    def __init__(self, src: ShardMap):
        self.pieces: dict[str, list[tuple[int, str, Box, Box]]] = defaultdict(list)
        for rank in sorted(src.ranks):
            for key, local in src.ranks[rank].items():
                for piece in local.pieces:
                    self.pieces[piece.hf_name].append((rank, key, piece.local_box, piece.hf_box))
        ids: dict[tuple, int] = {}
        self._geometry = {
            name: ids.setdefault(tuple((r, lb, hb) for r, _, lb, hb in pieces), len(ids))
            for name, pieces in self.pieces.items()
        }
        self._splits: dict[tuple, list[tuple[Box, tuple[int, ...]]]] = {}

    def regions(self, hf_name: str, want: Box, dst_key: str, dst_label: str):
        """Split `want` into the regions source pieces cut it into; each with all its
        holders. Source replicas hold identical regions, so grouping by box finds the
        replica set. Raises PlanError when the pieces miss part of `want` or overlap."""
        pieces = self.pieces.get(hf_name, [])
        memo = (self._geometry.get(hf_name), want)
        split = self._splits.get(memo)
        if split is None:
            split = self._splits[memo] = _split(pieces, hf_name, want, dst_key, dst_label)
        return [(region, [pieces[i] for i in holders]) for region, holders in split]


def _split(pieces, hf_name: str, want: Box, dst_key: str, dst_label: str):
    """`_SourceIndex.regions` worked out: [(region, indices of its holders in `pieces`)]."""
    regions: dict[Box, list[int]] = {}
    for i, (_, _, _, hf_box) in enumerate(pieces):
        region = intersect(want, hf_box)
        if region is not None:
            regions.setdefault(region, []).append(i)
    covered, wanted = sum(box_numel(r) for r in regions), box_numel(want)
    if covered != wanted or (len(regions) > 1 and _overlapping(list(regions))):
        held = "do not hold" if covered < wanted else "hold in overlapping pieces"
        raise PlanError(
            f"{dst_label} tensor {dst_key} needs {hf_name}{list(want)}, which the "
            f"source ranks {held} (covered {covered} of {wanted} elements)"
        )
    return [(region, tuple(holders)) for region, holders in sorted(regions.items())]


def _overlapping(boxes: list[Box]) -> bool:
    return any(intersect(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


# a transfer cut to fit a bucket is cut at multiples of this many rows where a bucket holds
# that many: the pieces of a transfer that starts on a 128-row boundary then start on one
# too, so block-wise FP8 senders can still quantize them (resharding/fp8.sender_tensors)
CUT_ROWS = 128


def _split_to_fit(
    transfers: list[Transfer], bucket_bytes: int, element_size: int
) -> list[Transfer]:
    """Cut transfers larger than a bucket along the HF tensor's leading dim (at least one row
    each; a multiple of `CUT_ROWS` where a bucket holds that many). A stacked expert box
    carries an extra leading extent-1 dim: it is kept whole."""
    out = []
    for t in transfers:
        nbytes = t.numel * element_size
        if nbytes <= bucket_bytes:
            out.append(t)
            continue
        common = min(len(t.src_box), len(t.dst_box))
        s_lead, d_lead = len(t.src_box) - common, len(t.dst_box) - common
        (s0, s1), *rest = t.src_box[s_lead:]
        (d0, _), *drest = t.dst_box[d_lead:]
        row_bytes = max(1, nbytes // (s1 - s0))
        step = max(1, bucket_bytes // row_bytes)
        if step >= CUT_ROWS:  # cuts on the block grid of block-wise FP8 (resharding/fp8.py)
            step -= step % CUT_ROWS
        for start in range(0, s1 - s0, step):
            stop = min(start + step, s1 - s0)
            out.append(
                Transfer(
                    t.src_rank,
                    t.src_key,
                    (*t.src_box[:s_lead], (s0 + start, s0 + stop), *rest),
                    t.dst_rank,
                    t.dst_key,
                    (*t.dst_box[:d_lead], (d0 + start, d0 + stop), *drest),
                )
            )
    return out


def _pack_rounds(
    transfers: list[Transfer], bucket_bytes: int, element_size: int
) -> list[list[Transfer]]:
    """First-fit transfers into rounds where each rank sends ≤ bucket and receives ≤ bucket.
    Keeps each (src, dst) pair's transfers in plan order across rounds."""
    rounds: list[list[Transfer]] = []
    sent: list[dict[int, int]] = []
    recvd: list[dict[int, int]] = []
    pair_last: dict[tuple[int, int], int] = {}
    first_free: dict[tuple[str, int], int] = defaultdict(int)  # rounds before it are full
    for t in transfers:
        nbytes = t.numel * element_size
        k = max(
            pair_last.get((t.src_rank, t.dst_rank), 0),
            first_free[("s", t.src_rank)],
            first_free[("d", t.dst_rank)],
        )
        while True:
            if k == len(rounds):
                rounds.append([])
                sent.append(defaultdict(int))
                recvd.append(defaultdict(int))
            fits = (
                sent[k][t.src_rank] + nbytes <= bucket_bytes
                and recvd[k][t.dst_rank] + nbytes <= bucket_bytes
            )
            alone = sent[k][t.src_rank] == 0 and recvd[k][t.dst_rank] == 0
            if fits or alone:  # a single row larger than a bucket goes in a round of its own
                break
            k += 1
        rounds[k].append(t)
        sent[k][t.src_rank] += nbytes
        recvd[k][t.dst_rank] += nbytes
        pair_last[(t.src_rank, t.dst_rank)] = k
        for side, rank, used in (("s", t.src_rank, sent), ("d", t.dst_rank, recvd)):
            while (
                first_free[(side, rank)] < len(rounds)
                and used[first_free[(side, rank)]][rank] >= bucket_bytes
            ):
                first_free[(side, rank)] += 1
    return rounds
