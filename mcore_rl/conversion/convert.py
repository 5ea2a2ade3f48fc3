"""HF safetensors ↔ megatron-core dist checkpoint, streamed tensor by tensor.

hf-to-mcore  writes the grid-independent checkpoint of `checkpoint.layout` (the TP1·PP1 Megatron
             tensors, decoder layers stacked on a layer axis): one chunk per Megatron tensor,
             each built from the HF tensors' slices it holds (`layouts.materialize_rank` on a
             one-tensor view of the TP1 shard map) when DCP's writer reaches it (`dcp_io`).
             Beside it: `hf_config/` (the source's config.json, tokenizer and other non-weight
             files), megatron's `metadata.json` + `common.pt`, and `mcore_rl_checkpoint.json`.
             It loads with `dist_checkpointing.load(model.sharded_state_dict(), dir)` at any
             TP/PP/VPP: DCP reads each rank's region from the stored chunks.
mcore-to-hf  reads any such checkpoint (this converter's, or one megatron saved at any grid,
             with stacked or per-layer keys, vocab padded to any size ≥ vocab) one Megatron
             tensor at a time — only the region its HF pieces cover — and writes the HF tensors
             it holds straight into pre-planned safetensors files (`safetensors_io`).
             The pieces come from the same TP1 shard map (`layouts.megatron_shards`); they are
             copied out directly instead of through `layouts.assemble_hf`, which allocates every
             HF tensor plus a coverage mask next to the input (≈2.5× a tensor instead of ≤2×).
             A LoRA run's checkpoint (`lora_checkpoint`: the frozen base, the adapters and
             lora.json) gives the merged model: every adapted HF weight is written as
             W + (alpha / rank)·B·A, computed in float32 and cast to the output dtype. Each
             rank reads the adapters of the weights in its share (r·(in + out) values each).

Memory per rank: the Megatron chunk being built plus one HF slice (hf-to-mcore), or the region
being read plus DCP's stored chunk while it copies (mcore-to-hf; an adapted weight's region
is read in float32) — about twice the largest tensor, plus a fixed interpreter/library
overhead. Never the model.

Ranks (`ranks.Ranks`): every rank validates the input identically, then converts its share of
the tensors (largest first onto the least-loaded rank); rank 0 writes the small files and
renames the finished temp dir into place (`output`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from mcore_rl.conversion import output
from mcore_rl.conversion.dcp_io import ChunkReader, TensorChunk, save_chunks
from mcore_rl.conversion.errors import ConversionError
from mcore_rl.conversion.hf_source import (
    PreadSafetensors,
    check_hf_tensors,
    copy_side_files,
    read_config,
    read_spec,
)
from mcore_rl.conversion.layout import AdapterLayout, CkptLayout, CkptTensor, checkpoint_layout
from mcore_rl.conversion.lora_checkpoint import (
    AdapterMerge,
    LoraMeta,
    checked_adapters,
    lora_meta_of,
    read_adapters,
)
from mcore_rl.conversion.ranks import Ranks, current_ranks, partition
from mcore_rl.conversion.safetensors_io import (
    create_files,
    fsync_files,
    plan_shards,
    write_index,
    write_tensor,
)
from mcore_rl.layouts import LocalTensor, ShardMap, materialize_rank
from mcore_rl.layouts.layout import box_slices
from mcore_rl.models.hf_factory import hf_config_from_spec
from mcore_rl.models.spec import ModelSpec

HF_CONFIG_DIR = "hf_config"
METADATA_FILE = "mcore_rl_checkpoint.json"
FORMAT = "mcore-rl/megatron-dist-checkpoint"
FORMAT_VERSION = 1
DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9


@dataclass(frozen=True)
class ConvertReport:
    direction: str
    src: str
    dst: str
    tensors: int
    bytes: int
    seconds: float
    ranks: int
    dtype: str
    # mcore-to-hf of a LoRA checkpoint: how many HF weights got their adapter merged in, and
    # the adapters' scale alpha / rank.
    merged: int = 0
    lora_scale: float | None = None

    def summary(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9) / 2 ** 20
        merged = (f"; {self.merged} of them merged with their LoRA adapters "
                  f"(W + {self.lora_scale:g}·B·A)" if self.merged else "")
        return (f"{self.direction}: {self.tensors} tensors, {self.bytes / 2 ** 20:.1f} MiB "
                f"({self.dtype}) in {self.seconds:.2f} s ({rate:.0f} MiB/s) on {self.ranks} "
                f"rank(s) -> {self.dst}{merged}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- hf-to-mcore ------------------------------------------------------------------------------


def _my_share(items: list, sizes: list[int], ranks: Ranks) -> list:
    """This rank's items when `items` are spread over the ranks by size."""
    owner = partition(sizes, ranks.world)
    return [item for item, rank in zip(items, owner) if rank == ranks.rank]


@contextmanager
def _staging(ranks: Ranks, dst: Path, tmp_dir: Path | None):
    """The hidden directory every rank writes into (rank 0 names it, beside `dst`, unless
    `tmp_dir` is given); if anything fails rank 0 removes it, so no half-written output is
    left. Committing it to `dst` is the caller's last step inside the block."""
    tmp = ranks.broadcast(tmp_dir or (output.temp_dir_for(dst) if ranks.is_first else None))
    try:
        yield tmp
    except BaseException:
        if ranks.is_first:
            output.remove(tmp)
        raise


def hf_to_mcore(src: str | Path, dst: str | Path, *, dtype: torch.dtype | None = None,
                force: bool = False, progress: bool = True, ranks: Ranks | None = None,
                tmp_dir: Path | None = None) -> ConvertReport:
    """Convert the HF folder `src` into a dist checkpoint at `dst` (see the module docstring).
    `dtype`: stored dtype (None: each tensor's source dtype). `tmp_dir`: where to build it
    (default: a fresh hidden dir beside `dst`); every rank must pass the same one."""
    ranks = ranks or current_ranks()
    t0 = time.perf_counter()
    src, dst = Path(src).absolute(), Path(dst).absolute()

    def preflight():
        output.check_paths(src, dst, force=force)
        spec = read_spec(src)
        _, src_dtypes = check_hf_tensors(src, spec)      # validates headers, names, shapes
        weights = PreadSafetensors(src, src_dtypes)
        layout = checkpoint_layout(spec)
        return spec, layout, [_chunk(t, key, layout.tp1, weights, src_dtypes, dtype)
                              for t in layout.tensors for key in t.keys]
    spec, layout, chunks = ranks.agree(preflight)       # every rank, or none, goes on
    mine = _my_share(chunks, [c.nbytes for c in chunks], ranks)
    stored = sorted({str(c.dtype).removeprefix("torch.") for c in chunks})
    with _staging(ranks, dst, tmp_dir) as tmp:
        def prepare():
            if ranks.is_first:
                tmp.mkdir(parents=True)
                copy_side_files(src, tmp / HF_CONFIG_DIR)
        ranks.agree(prepare)
        with _Progress("hf-to-mcore", sum(c.nbytes for c in mine), len(mine), ranks,
                       progress) as bar:
            save_chunks(tmp, mine, {key: [None] for key in layout.objects}
                        if ranks.is_first else {}, distributed=ranks.distributed,
                        on_chunk=lambda chunk, tensor: bar.advance(chunk.nbytes))
        n, nbytes = (int(v) for v in ranks.sum([len(mine), sum(c.nbytes for c in mine)]))

        def finish():
            if ranks.is_first:
                _write_megatron_files(tmp)
                _write_metadata(tmp, src, spec, layout, stored, n, nbytes)
                output.commit(tmp, dst, force=force)
        ranks.agree(finish)
    return ConvertReport("hf-to-mcore", str(src), str(dst), n, nbytes,
                         time.perf_counter() - t0, ranks.world, "/".join(stored))


def _chunk(t: CkptTensor, key: str, tp1: ShardMap, weights,
           src_dtypes: dict[str, torch.dtype], dtype: torch.dtype | None) -> TensorChunk:
    """`t` stored under `key` (its key or an alias), built when the writer reaches it."""
    local = t.local
    part_dtypes = {src_dtypes[p.hf_name] for p in local.pieces}
    if dtype is None and len(part_dtypes) > 1:
        raise ConversionError(f"{local.key} fuses HF tensors of different dtypes "
                              f"{sorted(map(str, part_dtypes))}: pass --dtype")
    out_dtype = dtype or part_dtypes.pop()
    view = ShardMap(tp1.side, tp1.family, tp1.hf_shapes, ranks={0: {local.key: local}})

    def make() -> torch.Tensor:
        # materialize_rank reads only the HF rows each piece needs (one pread per piece).
        tensor = materialize_rank(view, 0, weights.__getitem__, out_dtype)[local.key]
        return tensor.view(t.chunk_sizes)       # the prepended layer (and expert) axes

    return TensorChunk(key, t.global_shape, t.chunk_offsets, t.chunk_sizes, out_dtype, make)


def _write_megatron_files(out: Path) -> None:
    """What `dist_checkpointing.save` writes besides the sharded tensors: `metadata.json`
    (backend) and `common.pt` (the non-sharded state: none for a GPTModel)."""
    # lazy: megatron
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    save_config(CheckpointingConfig(sharded_backend="torch_dist"), str(out))
    torch.save({}, out / "common.pt")


def _write_metadata(out: Path, src: Path, spec, layout: CkptLayout, dtypes: list[str],
                    tensors: int, nbytes: int) -> None:
    import megatron.core  # lazy: megatron

    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "source": str(src), "architecture": spec.architecture,
        "spec": dataclasses.asdict(spec), "dtypes": dtypes,
        "layer_keys": "stacked",  # decoder layers on a prepended axis (see checkpoint.layout)
        "checkpoint_keys": layout.tensor_keys(), "extra_state_objects": len(layout.objects),
        "hf_config_dir": HF_CONFIG_DIR, "tensors": tensors, "bytes": nbytes,
        "megatron_core": megatron.core.__version__, "torch": torch.__version__,
        "created_unix": time.time(),
    }
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")


# --- mcore-to-hf ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ReadUnit:
    """One Megatron tensor to read: `key` region at `offsets` with shape `region` (its first
    `lead` dims the checkpoint's layer/expert axes, extent 1), and the HF tensors it holds
    (each as pieces of the region)."""

    key: str
    offsets: tuple[int, ...]
    region: tuple[int, ...]
    lead: int
    local: LocalTensor
    hf: tuple[tuple[str, tuple[int, ...]], ...]     # (HF name, HF shape) of what it holds
    dtype: torch.dtype

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.hf)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.region:
            n *= s
        return n


def mcore_to_hf(src: str | Path, dst: str | Path, *, hf_config: str | Path | None = None,
                dtype: torch.dtype | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, force: bool = False,
                progress: bool = True, ranks: Ranks | None = None,
                tmp_dir: Path | None = None) -> ConvertReport:
    """Convert the dist checkpoint `src` into an HF folder at `dst`. `hf_config`: a folder with
    the model's config.json (+ tokenizer); default `src/hf_config` (written by hf-to-mcore), or
    for a LoRA checkpoint the base recorded in its lora.json. A LoRA checkpoint's adapters are
    merged into the weights they adapt (module docstring)."""
    ranks = ranks or current_ranks()
    t0 = time.perf_counter()
    src, dst = Path(src).absolute(), Path(dst).absolute()

    # every rank, or none, goes on
    reader, config_dir, spec, layout, units, lora, adapters = ranks.agree(
        lambda: _open_source(src, dst, hf_config, dtype, force=force))
    shapes = layout.tp1.hf_shapes
    unit_of = {name: u for u in units for name in u.hf_names}
    order = sorted(shapes, key=_natural_key)
    plan = plan_shards([(n, shapes[n], unit_of[n].dtype) for n in order], max_shard_bytes)
    mine = _my_share(units, [u.nbytes for u in units], ranks)
    out_dtypes = sorted({str(u.dtype).removeprefix("torch.") for u in units})
    with _staging(ranks, dst, tmp_dir) as tmp:
        def prepare():
            if ranks.is_first:
                tmp.mkdir(parents=True)
                create_files(tmp, plan)
                write_index(tmp, plan)
                _write_hf_config(config_dir, tmp, spec, _major_dtype(units))
                copy_side_files(config_dir, tmp, skip=("config.json",))
        ranks.agree(prepare)
        my_bytes = sum(plan.slots[n].nbytes for u in mine for n in u.hf_names)
        my_tensors = sum(len(u.hf_names) for u in mine)

        def convert() -> int:
            touched = set()
            merge = _adapters_of(reader, adapters, lora, mine)
            with _Progress("mcore-to-hf", my_bytes, my_tensors, ranks, progress) as bar:
                def emit(name: str, tensor: torch.Tensor) -> None:
                    write_tensor(tmp, plan.slots[name], tensor)
                    touched.add(plan.slots[name].file)
                    bar.advance(plan.slots[name].nbytes)
                for unit in mine:
                    _read_unit(reader, unit, emit, merge)
            fsync_files(tmp, sorted(touched))
            return sum(merge.adapts(n) for u in mine for n in u.hf_names) if merge else 0
        my_merged = ranks.agree(convert)
        n, nbytes, merged = (int(v) for v in ranks.sum([my_tensors, my_bytes, my_merged]))

        def finish():
            if ranks.is_first:
                output.commit(tmp, dst, force=force)
        ranks.agree(finish)
    return ConvertReport("mcore-to-hf", str(src), str(dst), n, nbytes,
                         time.perf_counter() - t0, ranks.world, "/".join(out_dtypes),
                         merged=merged, lora_scale=lora.config.scale if lora else None)


def _open_source(src: Path, dst: Path, hf_config: str | Path | None,
                 dtype: torch.dtype | None, *, force: bool) -> tuple:
    """mcore_to_hf's checks and reads before anything is written: the paths, the checkpoint
    (its LoRA adapters, if any), the model's config folder, its spec and layout, and the
    read units. Returns (reader, config_dir, spec, layout, units, lora meta, adapters)."""
    output.check_paths(src, dst, force=force)
    reader = open_checkpoint(src)
    lora = lora_meta_of(src, reader)
    config_dir = model_config_dir(src, hf_config, lora.base_model if lora else None)
    spec = read_spec(config_dir)
    layout = checkpoint_layout(spec)
    adapters = checked_adapters(reader, layout, lora.config) if lora else None
    return (reader, config_dir, spec, layout, _plan_reads(layout, reader, dtype), lora,
            adapters)


def _adapters_of(reader: ChunkReader, adapters: AdapterLayout | None, lora: LoraMeta | None,
                 units: list[_ReadUnit]) -> AdapterMerge | None:
    """The adapters of the weights in `units` (this rank's share), ready to merge."""
    if adapters is None:
        return None
    tensors = read_adapters(reader, adapters, {u.local.key for u in units})
    return AdapterMerge(lora.config.scale, tensors)


def model_config_dir(src: Path, hf_config: str | Path | None,
                     base_model: str | None = None) -> Path:
    """The folder with the model's HF config.json (+ tokenizer): `hf_config` if given, else
    `src/hf_config` (hf-to-mcore writes it), else `base_model` (a LoRA checkpoint's base)."""
    tried = ([Path(hf_config).absolute()] if hf_config else
             [src / HF_CONFIG_DIR] + ([Path(base_model)] if base_model else []))
    for folder in tried:
        if (folder / "config.json").is_file():
            return folder
    raise ConversionError(f"{' or '.join(map(str, tried))}: no config.json; pass --hf-config "
                          "DIR (a folder with the model's HF config.json and tokenizer)")


def open_checkpoint(src: Path) -> ChunkReader:
    if not (src / ".metadata").is_file():
        raise ConversionError(f"{src}: not a megatron-core torch_dist checkpoint (no .metadata)")
    try:
        return ChunkReader(src)
    except Exception as err:  # unpickling a corrupt .metadata raises many types
        raise ConversionError(f"{src}/.metadata: unreadable ({type(err).__name__}: {err})") \
            from None


def _plan_reads(layout: CkptLayout, reader: ChunkReader,
                dtype: torch.dtype | None) -> list[_ReadUnit]:
    """Locate every TP1 Megatron tensor in the checkpoint and check its stored shape; the
    region read is what its HF pieces cover (a padded vocab is cut to the real rows)."""
    hf_by_local: dict[str, list[str]] = {}
    for name, t in layout.hf_units().items():
        hf_by_local.setdefault(t.local.key, []).append(name)
    units, problems = [], []
    for t in layout.tensors:
        extent = tuple(max(p.local_box[d][1] for p in t.local.pieces)
                       for d in range(len(t.local.shape)))
        found = t.stored_form(reader)
        if found is None:
            problems.append(f"missing tensor {t.key}"
                            + (f" (or {', '.join(t.aliases)})" if t.aliases else ""))
            continue
        key, axes = found
        md = reader.tensor_metadata(key)
        lead = len(axes)
        want = tuple(n for _, n in axes) + t.local.shape
        found = tuple(md.size)
        # Dims the HF pieces do not fill (vocab padding) may be stored at any size >= needed.
        padded = [t.local.shape[d] != extent[d] for d in range(len(extent))]
        ok = len(found) == len(want) and all(
            (f >= extent[d - lead]) if d >= lead and padded[d - lead] else f == w
            for d, (f, w) in enumerate(zip(found, want)))
        if not ok:
            problems.append(f"tensor {key}: expected shape {want}"
                            + (" (dims padded by the saver may be larger)" if any(padded) else "")
                            + f", found {found}")
            continue
        units.append(_ReadUnit(
            key=key, offsets=tuple(i for i, _ in axes) + (0,) * len(extent),
            region=(1,) * lead + extent, lead=lead, local=t.local,
            hf=tuple((n, tuple(layout.tp1.hf_shapes[n])) for n in hf_by_local[t.local.key]),
            dtype=dtype or md.properties.dtype))
    problems = list(dict.fromkeys(problems))   # a stacked key is checked once per layer
    if problems:
        raise ConversionError(f"{reader.dir}: checkpoint does not match the model config: "
                              + "; ".join(problems[:5])
                              + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    return units


def _read_unit(reader: ChunkReader, unit: _ReadUnit, emit: Callable[[str, torch.Tensor], None],
               merge: AdapterMerge | None = None) -> None:
    """Read one Megatron tensor's region and emit the HF tensors it holds, each once; those
    `merge` adapts with their adapter merged in (in float32, then cast to the unit's dtype)."""
    adapted = {n for n in unit.hf_names if merge is not None and merge.adapts(n)}
    region = torch.empty(unit.region, dtype=torch.float32 if adapted else unit.dtype)
    reader.read([(unit.key, unit.offsets, region)])
    local = region[(0,) * unit.lead]
    for name, shape in unit.hf:
        tensor = _hf_tensor(local, unit, name, shape)
        if name in adapted:
            # In place, also on a view of the region: the region is this unit's alone and no
            # other HF tensor reads this part of it.
            merge.merge_(name, tensor)
        emit(name, tensor.to(unit.dtype))


def _hf_tensor(local: torch.Tensor, unit: _ReadUnit, name: str,
               shape: tuple[int, ...]) -> torch.Tensor:
    """The HF tensor `name` from the unit's TP1 tensor `local`: a view of it when it is one
    contiguous box, else a copy assembled from its pieces."""
    pieces = [p for p in unit.local.pieces if p.hf_name == name]
    if len(pieces) == 1 and pieces[0].hf_box == tuple((0, s) for s in shape):
        view = local[box_slices(pieces[0].local_box)]
        if view.is_contiguous():         # e.g. the embedding's real rows: no copy
            return view
    out = torch.empty(shape, dtype=local.dtype)
    for p in pieces:
        out[box_slices(p.hf_box)] = local[box_slices(p.local_box)]
    return out


def _major_dtype(units: list[_ReadUnit]) -> torch.dtype:
    count: dict[torch.dtype, int] = {}
    for u in units:
        count[u.dtype] = count.get(u.dtype, 0) + u.nbytes
    return max(count, key=count.get)


def _write_hf_config(config_dir: Path, out: Path, spec, dtype: torch.dtype) -> None:
    """config.json through the one HF-config writer, keeping the source's special token ids."""
    source = read_config(config_dir)
    config = hf_config_from_spec(spec, dtype=dtype, **{
        k: source.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    config.save_pretrained(out)
    if ModelSpec.from_hf_dir(out) != spec:
        raise ConversionError(f"{out}/config.json does not read back as the source model")


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# --- progress ---------------------------------------------------------------------------------


class _Progress:
    """tqdm bar (rank 0 only) over bytes, with the tensor count as postfix."""

    def __init__(self, what: str, total_bytes: int, total_tensors: int, ranks: Ranks,
                 enabled: bool):
        self.bar = None
        self.n, self.total = 0, total_tensors
        if enabled and ranks.is_first:
            desc = what if not ranks.distributed else f"{what} (rank 0 of {ranks.world})"
            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                            desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True)

    def advance(self, nbytes: int) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.n}/{self.total} tensors", refresh=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
