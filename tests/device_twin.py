"""Device twins: GPU-path functions run on the `meta` device on CPU machines.

On CPU every tensor sits on one device, so a tensor created without `device=` is invisible
there; on `meta` an op that mixes a CPU tensor (not a 0-dim one: those pass as scalars, as on
CUDA) into meta tensors raises, and placements can be asserted. The twins check placement
only; numbers stay checked by the CPU tests. `scripts/gpu_check.sh` runs them again with
MCORE_RL_TWIN_DEVICE=cuda on a GPU machine. Data-dependent ops (bincount, unique, .item())
do not run on meta: the tests call the pure piece behind such a host sync.
"""

from __future__ import annotations

import os

import torch

TWIN = torch.device(os.environ.get("MCORE_RL_TWIN_DEVICE", "meta"))


def twin(t: torch.Tensor) -> torch.Tensor:
    """A host-built tensor, placed on the twin device."""
    return t.to(TWIN)


def assert_on_twin(*tensors: torch.Tensor) -> None:
    for i, t in enumerate(tensors):
        assert t.device.type == TWIN.type, f"tensor {i}: on {t.device}, expected {TWIN.type}"
