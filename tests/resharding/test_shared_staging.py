"""The IPC staging buffer's allocation (C6): an expandable segment is CUDA virtual memory,
which exports no cudaIpcMemHandle, so with expandable segments on (PYTORCH_ALLOC_CONF or
PYTORCH_CUDA_ALLOC_CONF) the buffer is allocated with them turned off for the allocation and
back on after — even when the allocation fails — and every other allocator setting kept (N10). The CUDA allocation itself runs in
scripts/gpu_check.sh (tests/resharding/test_ipc_copy.py's GPU cases)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.resharding.shared_staging import classic_segments, expandable_segments_on

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.mark.parametrize("env,on", [
    ({}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    # torch reads the first variable set: PYTORCH_ALLOC_CONF's settings, not the other's
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128",
      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False),
])
def test_expandable_segments_are_read_from_either_variable(env, on):
    assert expandable_segments_on(env) is on


def test_the_buffer_is_allocated_in_classic_segments_and_the_setting_restored():
    calls = []
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with classic_segments(env, calls.append):
        assert calls == ["expandable_segments:False"]
        torch.empty(16, dtype=torch.uint8, device="meta")
    assert calls == ["expandable_segments:False", "expandable_segments:True"]
    with pytest.raises(RuntimeError), classic_segments(env, calls.append):
        raise RuntimeError("out of memory")
    assert calls[-1] == "expandable_segments:True"
    untouched = []
    with classic_segments({}, untouched.append):
        pass
    assert untouched == []


def test_the_other_allocator_settings_are_kept_through_the_block():
    """N10: torch resets every option a settings string leaves out, so the block flips
    expandable segments alone and puts the process's whole string back."""
    conf = "max_split_size_mb:512, expandable_segments:True,garbage_collection_threshold:0.6"
    calls = []
    with classic_segments({"PYTORCH_ALLOC_CONF": conf}, calls.append):
        pass
    assert calls == [
        "max_split_size_mb:512,expandable_segments:False,garbage_collection_threshold:0.6",
        conf]
