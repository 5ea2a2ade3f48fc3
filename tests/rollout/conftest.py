"""Rollout-test fixtures: one tiny random Llama folder (the `micro` preset, built by the shared
factory), weights scaled up so next-token distributions are peaked rather than near-uniform:
log-prob and greedy comparisons then mean something."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file, save_file

from mcore_rl.models.hf_factory import make_hf_model_dir

from .helpers import SPEC


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory):
    out = make_hf_model_dir(SPEC, tmp_path_factory.mktemp("micro"), seed=0)
    path = out / "model.safetensors"
    state = load_file(path)
    # HF init is normal(0, 0.02): logits vary by ~0.2 around uniform. x8 -> std 0.16.
    save_file({k: (v * 8 if v.ndim == 2 else v).contiguous() for k, v in state.items()}, path,
              metadata={"format": "pt"})
    return out


# Ray binds loopback only if this is set before ray is first imported (vLLM imports it); see
# mcore_rl.launch.ray_runtime.init_local_ray. Collected before any rollout test runs.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
