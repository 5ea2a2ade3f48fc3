"""Write an HF safetensors checkpoint one tensor at a time, from any number of ranks.

The safetensors format is an 8-byte little-endian header length, a JSON header giving every
tensor's dtype, shape and byte range, then the raw bytes. Every shape and dtype is known
before any data is read, so the whole layout is planned up front (`plan_shards`): tensors are
packed in order into files of at most `max_shard_bytes`, each file is created with its header
and its final size (`create_files`, rank 0), and afterwards any rank writes any tensor's bytes
at its offset (`write_tensor`, `os.pwrite`) — no rank ever holds more than the tensor it is
writing, and ranks need no coordination beyond "files exist" and "all written".
File names and the index follow `transformers`' save_pretrained: one file is
`model.safetensors`; several are `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.float64: "F64"}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Slot:
    """Where one tensor's bytes go: `file` at byte `offset` (absolute), `nbytes` long."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ShardPlan:
    files: dict[str, bytes]          # file name → its complete header (length prefix included)
    sizes: dict[str, int]            # file name → final size in bytes
    slots: dict[str, Slot]           # tensor name → slot

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values())


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def plan_shards(entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                max_shard_bytes: int) -> ShardPlan:
    """Pack (name, shape, dtype) entries, in order, into files of at most `max_shard_bytes`
    of tensor data (a larger tensor gets a file of its own)."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be >= 1")
    groups: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
    used = 0
    for name, shape, dtype in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors here")
        size = _nbytes(shape, dtype)
        if groups[-1] and used + size > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, tuple(shape), dtype, size))
        used += size
    n = len(groups)
    files, sizes, slots = {}, {}, {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        begin = 0
        for name, shape, dtype, size in group:
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [begin, begin + size]}
            begin += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)          # safetensors aligns the data section to 8
        files[fname] = struct.pack("<Q", len(raw)) + raw
        data_start = len(files[fname])
        sizes[fname] = data_start + begin
        for name, shape, dtype, size in group:
            offset = data_start + header[name]["data_offsets"][0]
            slots[name] = Slot(name, fname, shape, dtype, offset, size)
    return ShardPlan(files, sizes, slots)


def create_files(out_dir: Path, plan: ShardPlan) -> None:
    """Create every shard file with its header, at its final (sparse) size."""
    for fname, header in plan.files.items():
        with open(out_dir / fname, "wb") as f:
            f.write(header)
            f.truncate(plan.sizes[fname])


def write_tensor(out_dir: Path, slot: Slot, tensor: torch.Tensor) -> None:
    """Write one tensor's bytes into its slot (the file must exist)."""
    if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
        raise ValueError(f"{slot.name}: got {tuple(tensor.shape)} {tensor.dtype}, the plan "
                         f"has {slot.shape} {slot.dtype}")
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(data)
    fd = os.open(out_dir / slot.file, os.O_WRONLY)
    try:
        done = 0
        while done < slot.nbytes:      # pwrite may write less than asked
            done += os.pwrite(fd, view[done:], slot.offset + done)
    finally:
        os.close(fd)


def write_index(out_dir: Path, plan: ShardPlan) -> None:
    """`model.safetensors.index.json` (only when there are several files, as HF does)."""
    if len(plan.files) < 2:
        return
    index = {"metadata": {"total_size": plan.total_bytes},
             "weight_map": {name: slot.file for name, slot in plan.slots.items()}}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def fsync_files(out_dir: Path, names) -> None:
    for name in names:
        fd = os.open(out_dir / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB', '1000' → bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "B": 1}
    for unit, scale in units.items():
        if s.endswith(unit):
            number = s[: -len(unit)]
            break
    else:
        number, scale = s, 1
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"size {text!r}: expected e.g. 5GB, 500MB, 2GiB or a byte count") \
            from None
    if value <= 0:
        raise ValueError(f"size {text!r}: must be > 0")
    return int(value * scale)
