"""HF-named weight sources that hand out one tensor (or one slice of it) at a time.

`SafetensorsWeights` reads an HF model directory lazily: indexing returns a safetensors slice
handle, so `weights[name][a:b]` reads only those rows — a rank materializing its shard never
loads whole tensors it does not need. `RandomWeights` makes reproducible random tensors from
shapes alone (benchmarks and tests), each from its own seed so any rank can make any tensor.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open


class WeightsError(ValueError):
    """A weights file is missing, corrupt, or disagrees with what was expected."""


class SafetensorsWeights:
    """HF safetensors checkpoint (single file or sharded with `model.safetensors.index.json`)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self._handles: dict[Path, object] = {}
        self._file_of = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise WeightsError(f"{index}: not a valid safetensors index ({err})") from None
            return {name: self.dir / file for name, file in weight_map.items()}
        single = self.dir / "model.safetensors"
        if not single.is_file():
            raise WeightsError(f"{self.dir}: no model.safetensors or "
                               "model.safetensors.index.json")
        return {name: single for name in self._open(single).keys()}

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise WeightsError(f"{path}: listed in the index but missing")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise WeightsError(f"{path}: cannot read safetensors header ({err})") from None
        return self._handles[path]

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].get_shape())

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def __getitem__(self, name: str):
        if name not in self._file_of:
            raise WeightsError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        return self._open(self._file_of[name]).get_slice(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self[name][:]


class RandomWeights:
    """Deterministic random HF tensors: tensor `name` depends only on (seed, name, shape)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], seed: int = 0,
                 dtype: torch.dtype = torch.float32, scale: float = 0.02):
        self.shapes, self.seed, self.dtype, self.scale = dict(shapes), seed, dtype, scale

    def names(self) -> list[str]:
        return sorted(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise WeightsError(f"no tensor {name!r} in this model")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return (torch.randn(self.shapes[name], generator=g) * self.scale).to(self.dtype)

    tensor = __getitem__
