"""Where the transport's buffers live: staging follows the tensors it carries (send side: the
parameter's device; receive side: the `device` argument), the wire's device when the group
needs one (gloo: host memory). One process, no process group: the `meta` device stands in
for a device that is not the host, and a recording group stands in for the sync group."""
import pytest

import torch

from mcore_rl.layouts import megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import P2PCopy, SyncStats, build_plan, receive_shards, send_shards

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

MICRO = get_preset("micro")


class _Done:
    def wait(self, *_):
        return True


class RecordingGroup:
    """Records the device, dtype and size of every buffer handed to send/recv."""

    def __init__(self):
        self.sent, self.received = [], []

    def send(self, tensors, peer, tag):
        self.sent.append((tensors[0].device.type, tensors[0].dtype, tensors[0].numel(), peer))
        return _Done()

    def recv(self, tensors, peer, tag):
        self.received.append((tensors[0].device.type, tensors[0].dtype, tensors[0].numel(), peer))
        return _Done()


def _plan(element_size=4):
    src, dst = megatron_shards(MICRO, ParallelConfig(tp=2)), vllm_shards(MICRO, 2)
    return src, build_plan(src, dst, bucket_bytes=16 << 10, element_size=element_size)


def _meta_params(src, rank):
    return {key: torch.empty(local.shape, device="meta") for key, local in src.ranks[rank].items()}


def test_send_staging_lives_on_the_parameters_device():
    src, plan = _plan()
    group = RecordingGroup()
    stats = send_shards(plan, group, 0, _meta_params(src, 0), dtype=torch.float32)
    assert group.sent and {d for d, *_ in group.sent} == {"meta"}
    assert stats.zero_copy_messages == stats.messages  # TP2 -> TP2: whole contiguous slices
    # a bf16 wire from fp32 parameters packs every message: the staging is on their device
    src, plan = _plan(element_size=2)
    group = RecordingGroup()
    stats = send_shards(plan, group, 0, _meta_params(src, 0), dtype=torch.bfloat16)
    assert {(d, t) for d, t, *_ in group.sent} == {("meta", torch.bfloat16)}
    assert stats.zero_copy_messages == 0
    # two rounds in flight (double-buffered staging): at most two buckets
    assert 0 < stats.peak_extra_bytes <= 2 * plan.bucket_bytes


def test_gloo_wire_bounces_device_tensors_through_host_buffers():
    _, plan = _plan()
    # (meta tensors cannot be copied to the host, so the buffer choice is checked directly)
    copy = P2PCopy(RecordingGroup(), wire_device="cpu")
    copy.start(plan, 0, sending=True, dtype=torch.float32, timeout_s=1.0, stats=SyncStats())
    view = torch.empty(4, 8, device="meta")[:, :4]
    assert copy._recv_buffer([view[0]])[0].device.type == "cpu"
    assert copy._recv_buffer([view])[0].device.type == "cpu"
    host = torch.zeros(8)
    assert copy._recv_buffer([host])[0] is host  # contiguous and on the wire: zero copy
    assert copy._pack([host])[0].data_ptr() == host.data_ptr()


def test_receive_assembles_on_the_device_argument():
    _, plan = _plan()
    me = plan.num_src  # inference rank 0
    group = RecordingGroup()
    received = dict(receive_shards(plan, group, me, dtype=torch.float32, device="meta"))
    assert set(received) == plan.expected_names(me)
    assert {t.device.type for t in received.values()} == {"meta"}
    assert {d for d, *_ in group.received} == {"meta"}  # staging too, never the host
    group = RecordingGroup()
    received = dict(receive_shards(plan, group, me, dtype=torch.float32,
                                   copy=P2PCopy(group, wire_device="cpu"), device="cpu"))
    assert {t.device.type for t in received.values()} == {"cpu"}
