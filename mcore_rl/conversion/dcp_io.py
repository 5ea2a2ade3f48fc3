"""Stream tensors into and out of a megatron-core `torch_dist` checkpoint, one chunk at a time.

Why not `megatron.core.dist_checkpointing.save`: it needs every tensor of the rank up front as
a ShardedTensor with its data (a whole model in memory for a one-process conversion), and its
writer (`FileSystemWriterAsync.preload_tensors`) copies all of a rank's tensors before writing
(and then calls torch.cuda.synchronize(), which fails on CPU-only machines in 0.16.1).
The format underneath is plain `torch.distributed.checkpoint` (DCP): a pickled `.metadata`
(global shape and chunk list per key, byte range of every chunk) plus `*.distcp` files of
`torch.save`d chunks. So the writer here is DCP itself (`dcp.save` with its `FileSystemWriter`:
same files, same metadata, loadable by `dist_checkpointing.load`), driven by
`StreamingSavePlanner`, whose `resolve_data` builds each chunk only when the writer asks for it.

Memory: torch 2.13's `_write_files_from_queue` keeps the last tensor of every key written to
a file alive until that file is closed (its `tensor_dict`, used by the safetensors format), so
one file holding many tensors would keep many alive. `OneTensorPerFileWriter` therefore puts
each tensor chunk in its own file (all small extra-state objects share one), which bounds a
rank to the chunk being built plus the HF slice being copied into it.

Reading (`ChunkReader`) uses DCP's `FileSystemReader` with a planner that copies each stored
chunk's overlap straight into a caller-provided destination; DCP loads one stored chunk at a
time, so a read holds the destination plus one stored chunk.
"""

from __future__ import annotations

import dataclasses
import io
import os
import queue
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mcore_rl.conversion.ranks import RankFailed


class TensorChunk:
    """A chunk to write: `key`'s region at `offsets` of size `sizes` (global `shape`), built by
    `make()` when the writer reaches it."""

    def __init__(self, key: str, shape: tuple[int, ...], offsets: tuple[int, ...],
                 sizes: tuple[int, ...], dtype: torch.dtype, make: Callable[[], torch.Tensor]):
        self.key, self.shape, self.offsets, self.sizes = key, shape, offsets, sizes
        self.dtype, self.make = dtype, make

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.sizes:
            n *= s
        return n

    def write_item(self) -> WriteItem:
        return WriteItem(
            index=MetadataIndex(self.key, self.offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(self.offsets),
                                           sizes=torch.Size(self.sizes)),
                properties=TensorProperties(dtype=self.dtype), size=torch.Size(self.shape)))


class StreamingSavePlanner(DefaultSavePlanner):
    """A SavePlanner over a table of chunks and objects instead of a state dict of tensors.

    `resolve_data` calls the chunk's `make()` (and `on_chunk(chunk, tensor)` after checking the
    shape); objects are `torch.save`d values. Ranks pass disjoint tables.
    """

    def __init__(self, chunks: Iterable[TensorChunk], objects: dict[str, object],
                 on_chunk: Callable[[TensorChunk, torch.Tensor], None] | None = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {MetadataIndex(c.key, c.offsets): c for c in chunks}
        self._objects = dict(objects)
        self._on_chunk = on_chunk

    def create_local_plan(self) -> SavePlan:
        items = [c.write_item() for c in self._chunks.values()]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                  for key in self._objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self._objects[write_item.index.fqn], buf)
            return buf
        chunk = self._chunks[MetadataIndex(write_item.index.fqn, write_item.index.offset)]
        tensor = chunk.make()
        if tuple(tensor.shape) != chunk.sizes or tensor.dtype != chunk.dtype:
            raise ValueError(f"{chunk.key} at {chunk.offsets}: built {tuple(tensor.shape)} "
                             f"{tensor.dtype}, planned {chunk.sizes} {chunk.dtype}")
        if self._on_chunk is not None:
            self._on_chunk(chunk, tensor)
        return tensor


class OneTensorPerFileWriter(FileSystemWriter):
    """FileSystemWriter with one file per tensor chunk (all byte objects in one file): see the
    module docstring for why. Files are `__<rank>_<i>.distcp` as DCP names them."""

    def __init__(self, path: str | Path):
        # No fsync per file (it slows every save down): `save_chunks` flushes the rank's files at
        # the end.
        super().__init__(path, single_file_per_rank=False, sync_files=False, thread_count=1)

    def write_data(self, plan: SavePlan, planner):
        if not hasattr(self, "_write_data"):   # other torch: the public one-file-per-item mode
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        bytes_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        buckets = ([bytes_items] if bytes_items else []) + [
            [i] for i in plan.items if i.type != WriteItemType.BYTE_IO]
        file_queue: queue.Queue = queue.Queue()
        for n, bucket in enumerate(buckets):
            name = f"{prefix}{n}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, file_queue)


def save_chunks(out_dir: Path, chunks: list[TensorChunk], objects: dict[str, object], *,
                distributed: bool,
                on_chunk: Callable[[TensorChunk, torch.Tensor], None] | None = None) -> Metadata:
    """Write this rank's chunks and objects; with `distributed`, every rank of the default
    process group calls this with its own disjoint share and rank 0 writes `.metadata`."""
    planner = StreamingSavePlanner(chunks, objects, on_chunk)
    rank = torch.distributed.get_rank() if distributed else 0
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=".*save in a single process")
            metadata = dcp.save({}, storage_writer=OneTensorPerFileWriter(out_dir),
                                planner=planner, no_dist=not distributed)
    except CheckpointException as err:
        # DCP gathers every rank's exception into one; re-raise this rank's own (e.g. a
        # ConversionError naming a truncated file) so callers see what went wrong.
        if rank in err.failures:
            raise err.failures[rank][0] from None
        first = min(err.failures)
        exc = err.failures[first][0]
        raise RankFailed(f"rank {first} failed: {type(exc).__name__}: {exc}") from None
    for path in Path(out_dir).glob(f"__{rank}_*.distcp"):   # this rank's files (DCP prefix)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return metadata


class _IntoDestinations(LoadPlanner):
    """Copies each read straight into the destination registered for its (key, index)."""

    def __init__(self, destinations: dict[tuple[str, int], torch.Tensor]):
        self.destinations = destinations

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):  # not used
        raise NotImplementedError

    def create_local_plan(self):
        raise NotImplementedError

    def create_global_plan(self, global_plan):
        raise NotImplementedError

    def finish_plan(self, central_plan):
        raise NotImplementedError

    def load_bytes(self, read_item, value):
        raise NotImplementedError("ChunkReader reads tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self.destinations[(read_item.dest_index.fqn, read_item.dest_index.index)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            if start != 0 or length != dest.shape[dim]:
                dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class ChunkReader:
    """Reads regions of a dist checkpoint's global tensors into given tensors."""

    def __init__(self, ckpt_dir: str | Path):
        self.dir = Path(ckpt_dir)
        self._reader = FileSystemReader(str(self.dir))
        self.metadata: Metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def tensor_metadata(self, key: str) -> TensorStorageMetadata | None:
        md = self.metadata.state_dict_metadata.get(key)
        return md if isinstance(md, TensorStorageMetadata) else None

    def read(self, requests: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
        """Fill each destination tensor with `key`'s region starting at `offsets` (the region
        has the destination's shape). Regions not stored in the checkpoint raise."""
        items: list[ReadItem] = []
        destinations: dict[tuple[str, int], torch.Tensor] = {}
        for n, (key, offsets, dest) in enumerate(requests):
            md = self.tensor_metadata(key)
            if md is None:
                raise KeyError(f"{self.dir}: no tensor {key!r} in the checkpoint")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
            reads = create_read_items_for_chunk_list(key, md, [chunk])
            covered = sum(int(torch.Size(r.lengths).numel()) for r in reads)
            if covered != dest.numel():
                raise ValueError(f"{self.dir}: {key} region at {tuple(offsets)} of size "
                                 f"{tuple(dest.shape)} is not fully stored (global shape "
                                 f"{tuple(md.size)})")
            # Destinations are told apart by request number (one chunk per request here).
            items += [dataclasses.replace(r, dest_index=MetadataIndex(key, r.dest_index.offset, n))
                      for r in reads]
            destinations[(key, n)] = dest
        plan = self._reader.prepare_local_plan(LoadPlan(items))
        self._reader.read_data(plan, _IntoDestinations(destinations)).wait()
