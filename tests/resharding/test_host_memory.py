"""Huge-page host buffers for the receive side: ordinary contiguous tensors, zero-filled,
2 MiB-aligned when large; small or non-host requests fall back to torch."""
import pytest

import torch

from mcore_rl.resharding.host_memory import ReceivePool, empty_host

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


def test_large_host_buffers_are_aligned_zeroed_and_writable():
    t = empty_host((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    assert not t.any()
    t[1].fill_(2.5)
    assert t.sum().item() == 2.5 * (1 << 20)
    view = t[1:]
    del t  # a view keeps the mapping alive
    assert view[0, 0].item() == 2.5


def test_small_and_device_buffers_fall_back_to_torch():
    small = empty_host((4, 4), torch.bfloat16, zero=True)
    assert small.dtype == torch.bfloat16 and not small.any()
    meta = empty_host((1 << 22,), torch.float32, device="meta")
    assert meta.device.type == "meta"


def test_a_receive_pool_hands_back_last_syncs_memory_for_the_same_plan_only():
    pool = ReceivePool()
    pool.start(b"plan-a")
    first = pool.take("w", (1 << 20,), torch.float32, zero=True)
    assert not first.any()
    first.fill_(1.0)
    assert pool.take("w", (1 << 20,), torch.float32).data_ptr() == first.data_ptr()
    assert pool.nbytes == 4 << 20
    # another shape or dtype under the same key: fresh memory
    assert pool.take("w", (2, 1 << 19), torch.float32).data_ptr() != first.data_ptr()
    assert pool.take("w", (2, 1 << 19), torch.bfloat16).dtype == torch.bfloat16
    pool.start(b"plan-a")
    kept = pool.take("w", (2, 1 << 19), torch.bfloat16)
    pool.start(b"plan-b")  # another plan: nothing carried over
    assert pool.take("w", (2, 1 << 19), torch.bfloat16).data_ptr() != kept.data_ptr()
    # device memory is never pooled (torch's caching allocator reuses it already)
    meta = pool.take("m", (1 << 22,), torch.float32, device="meta")
    assert meta.device.type == "meta" and pool.nbytes == 2 << 20
