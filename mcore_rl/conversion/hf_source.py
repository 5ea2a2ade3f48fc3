"""HF model directories as conversion input/output: the spec, the tensors the layout expects
(checked by name, shape and dtype from the safetensors headers, before any data is read), and
the files that travel with the weights (config, tokenizer, generation config, ...)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import torch

from mcore_rl.conversion.errors import ConversionError
from mcore_rl.conversion.safetensors_io import TORCH_DTYPES
from mcore_rl.layouts import LayoutError, hf_shards
from mcore_rl.models.hf_weights import SafetensorsWeights, WeightsError
from mcore_rl.models.spec import ModelSpec, UnsupportedModelError

# Weight files: everything else in an HF folder (config, tokenizer, templates) is carried along.
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|"
                          r".*\.safetensors\.index\.json$|.*\.bin\.index\.json$")


def read_spec(config_dir: Path) -> ModelSpec:
    try:
        spec = ModelSpec.from_hf_dir(config_dir)
    except FileNotFoundError as err:
        raise ConversionError(str(err)) from None
    except UnsupportedModelError as err:
        raise ConversionError(f"{config_dir / 'config.json'}: {err}") from None
    except (KeyError, ValueError, TypeError) as err:
        raise ConversionError(f"{config_dir / 'config.json'}: cannot read the model config "
                              f"({type(err).__name__}: {err})") from None
    return spec


def read_config(config_dir: Path) -> dict:
    return json.loads((config_dir / "config.json").read_text())


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    try:
        return hf_shards(spec).hf_shapes
    except (KeyError, LayoutError) as err:
        raise ConversionError(str(err)) from None


def _ignorable(name: str, spec: ModelSpec) -> bool:
    """Tensors some HF checkpoints carry that are not weights of the model: rotary inverse
    frequencies (recomputed from the config) and, with tied embeddings, a stored copy of the
    embedding as lm_head."""
    return name.endswith(".rotary_emb.inv_freq") or (
        spec.tied_embeddings and name == "lm_head.weight")


def check_hf_tensors(src: Path, spec: ModelSpec) -> tuple[SafetensorsWeights,
                                                          dict[str, torch.dtype]]:
    """Open the safetensors of `src` and check they hold exactly the tensors the config
    implies, with the right shapes. Returns the reader and each tensor's dtype."""
    try:
        weights = SafetensorsWeights(src)
        names = set(weights.names())
        expected = expected_hf_shapes(spec)
        missing = sorted(set(expected) - names)
        if missing:
            raise ConversionError(
                f"{src}: {len(missing)} tensor(s) the config implies are missing: "
                f"{_first(missing)}")
        extra = sorted(n for n in names - set(expected) if not _ignorable(n, spec))
        if extra:
            raise ConversionError(
                f"{src}: {len(extra)} unexpected tensor(s), not part of a "
                f"{spec.architecture} with this config: {_first(extra)}")
        dtypes = {}
        for name, shape in expected.items():
            handle = weights[name]
            found = tuple(handle.get_shape())
            if found != tuple(shape):
                raise ConversionError(f"{src}: tensor {name} has shape {found}, expected "
                                      f"{tuple(shape)} (from config.json)")
            code = handle.get_dtype()
            if code not in TORCH_DTYPES:
                raise ConversionError(f"{src}: tensor {name} has dtype {code}; supported: "
                                      f"{', '.join(TORCH_DTYPES)}")
            dtypes[name] = TORCH_DTYPES[code]
    except WeightsError as err:
        raise ConversionError(str(err)) from None
    return weights, dtypes


def _first(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def side_files(model_dir: Path) -> list[Path]:
    """Top-level non-weight files of an HF folder (config, tokenizer, generation config...)."""
    return sorted(p for p in model_dir.iterdir()
                  if p.is_file() and not p.name.startswith(".") and not _WEIGHT_FILE.match(p.name))


def copy_side_files(model_dir: Path, out_dir: Path, *, skip: tuple[str, ...] = ()) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in side_files(model_dir):
        if p.name not in skip:
            shutil.copyfile(p, out_dir / p.name)
            copied.append(p.name)
    return copied


class PreadSafetensors:
    """Reads HF tensors (or row ranges of them) with `os.pread` into fresh tensors.

    `safetensors.safe_open` maps files into memory; pages a conversion has read stay mapped,
    and counted in the process's RSS, until the handle is dropped — so reading a whole model
    through long-lived handles grows RSS to the model's size. Here nothing is mapped: a read
    costs exactly the tensor it returns. Use after `check_hf_tensors` (which validates the
    headers through `SafetensorsWeights` and reports bad files clearly).
    """

    def __init__(self, model_dir: Path, names: dict[str, torch.dtype]):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        file_of = (json.loads(index.read_text())["weight_map"] if index.is_file()
                   else dict.fromkeys(names, "model.safetensors"))
        self._where: dict[str, tuple[Path, int, tuple[int, ...], torch.dtype]] = {}
        for fname in sorted(set(file_of[n] for n in names)):
            path = self.dir / fname
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name in names:
                    start = 8 + size + entry["data_offsets"][0]
                    self._where[name] = (path, start, tuple(entry["shape"]),
                                         TORCH_DTYPES[entry["dtype"]])

    def __getitem__(self, name: str) -> "_RowReader":
        return _RowReader(name, *self._where[name])


class _RowReader:
    """`reader[slices]` reads the rows the first slice selects (one pread), then applies the
    other slices; steps other than 1 are not supported."""

    def __init__(self, name: str, path: Path, start: int, shape: tuple[int, ...],
                 dtype: torch.dtype):
        self.name, self.path, self.start, self.shape, self.dtype = name, path, start, shape, dtype

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        if not self.shape:
            return self._read(0, 1).reshape(())
        r0, r1, step = index[0].indices(self.shape[0])
        if any(isinstance(i, slice) and i.step not in (None, 1) for i in index) or step != 1:
            raise ValueError(f"{self.name}: strided reads are not supported")
        rows = self._read(r0, max(r1 - r0, 0))
        rest = index[1:]
        if all(sl.indices(n)[:2] == (0, n) for sl, n in zip(rest, self.shape[1:])):
            return rows
        return rows[(slice(None), *rest)].contiguous()

    def _read(self, r0: int, nrows: int) -> torch.Tensor:
        out = torch.empty((nrows, *self.shape[1:]), dtype=self.dtype)
        buf = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else b""
        row_bytes = out[0].numel() * out.element_size() if nrows else 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], self.start + r0 * row_bytes + done)
                if n == 0:
                    raise ConversionError(f"{self.path}: ends inside tensor {self.name} "
                                          "(truncated file)")
                done += n
        finally:
            os.close(fd)
        return out
