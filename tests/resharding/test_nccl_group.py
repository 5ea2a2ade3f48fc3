"""The GPU sync group (B7, S1): point-to-point NCCL through vLLM's PyNcclCommunicator, no c10d
watchdog, one grouped launch per round. NCCL itself needs GPUs; here:
- which communicators each GPU config's sync world builds (no communicator holds two ranks of
  one device, every pair that moves bytes over the group shares one);
- how a rank joins them (the unique id's raw bytes through the store; who mints it), with
  vLLM's communicator constructor stood in by a recorder;
- the launch protocol on real gloo ranks: ops queue until the round is launched, and P2PCopy
  launches each round after posting it and before waiting for it — a full sync, bit-exact;
- a round's wait polls NCCL's asynchronous errors (the error code stood in for)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mcore_rl.config import load_config
from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.layouts import hf_shards, materialize_rank, megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.runconfig.resolve import resolve_run
from mcore_rl.resharding import SyncGroupSpec, build_plan, join_sync_group, sync_group_spec
from mcore_rl.resharding.copy_service import P2PCopy, SyncError, wait_work
from mcore_rl.resharding.nccl_group import NcclP2PGroup, RoundWork, communicators
from mcore_rl.resharding.transport import receive_shards, send_shards
from mcore_rl.runconfig import RLConfig

CONFIGS = Path(__file__).parents[2] / "configs"
GPU_RUNS = [(p.name, ()) for p in sorted((CONFIGS / "gpu").glob("*.yaml"))] + [
    ("llama3-70b.yaml", ("cluster.nodes=2", "cluster.placement=colocated", "actor.pp=2",
                         "rollout.engines=2", "rollout.enable_sleep=true"))]


def _spec_of(run) -> SyncGroupSpec:
    return sync_group_spec(run, host="127.0.0.1", port=1, prefix="p/", timeout_s=5.0)


@pytest.mark.parametrize("name,overrides", GPU_RUNS)
def test_communicators_never_hold_two_ranks_of_one_device(name, overrides):
    cfg = load_config(RLConfig, CONFIGS / "gpu" / name, list(overrides))
    run = resolve_run(cfg, cuda_available=False)
    spec = _spec_of(run)
    slots = list(run.placement.actor) + [s for e in run.placement.engines for s in e]
    comms = communicators(spec)
    for members in comms:
        devices = [(slots[r].node, slots[r].device) for r in members]
        assert len(set(devices)) == len(devices), (members, devices)
    # every actor → engine pair that moves bytes over the group shares a communicator
    engines = range(spec.actor_ranks, spec.world_size)
    for src in range(spec.actor_ranks):
        for dst in engines:
            transport = spec.pair_transport(_Plan(spec), src, dst)
            shared = any(src in m and dst in m for m in comms)
            assert shared == (transport == "p2p"), (src, dst, transport)
    if set(run.transports) == {"p2p"}:
        assert comms == [tuple(range(spec.world_size))]  # one world communicator
    elif run.placement.nodes == 1:
        assert comms == []  # all by IPC: the group is gloo and carries no bytes
    else:
        assert len(comms) == run.placement.nodes * (run.placement.nodes - 1)


class _Plan:
    """The two plan facts `SyncGroupSpec.pair_transport` reads."""

    def __init__(self, spec):
        self.num_src, self.num_dst = spec.actor_ranks, spec.world_size - spec.actor_ranks


class _RecordedComm:
    def __init__(self, unique_id, rank, world, device, disabled=False):
        self.args, self.disabled = (unique_id, rank, world, str(device)), disabled


def test_ranks_join_their_communicators_through_raw_store_bytes():
    """2 nodes, colocated: actor ranks 0,1 (node 0), 2,3 (node 1); engines 4,5 (node 0),
    6,7 (node 1). Communicators: {0,1,6,7} (node 0 → node 1) and {2,3,4,5}."""
    spec = SyncGroupSpec("127.0.0.1", 1, "p/", 8, backend="nccl", transports=("ipc", "ipc"),
                         nodes=(0, 0, 1, 1, 0, 0, 1, 1), actor_ranks=4)
    assert communicators(spec) == [(0, 1, 6, 7), (2, 3, 4, 5)]
    store, groups, minted = dist.HashStore(), {}, []

    def mint():
        minted.append(1)
        return bytes([len(minted)]) * 128

    def join(rank):
        groups[rank] = NcclP2PGroup(spec, rank, store, torch.device("cpu"),
                                    make_comm=_RecordedComm, mint_id=mint)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(minted) == 2  # one id per communicator, by its first member
    uid0, uid1 = (groups[0].comms[0].args[0], groups[2].comms[0].args[0])
    assert uid0 != uid1 and len(uid0) == 128
    assert groups[7].comms[0].args == (uid0, 3, 4, "cpu")
    assert groups[4].comms[0].args == (uid1, 2, 4, "cpu")
    assert groups[0].peer == {1: (0, 1), 6: (0, 2), 7: (0, 3)}
    with pytest.raises(ValueError, match="sync rank 0 shares no NCCL communicator with sync "
                                         "rank 4"):
        groups[0].send([torch.zeros(1)], 4)  # refused as it is posted
    with pytest.raises(RuntimeError, match="PyNccl is disabled here"):
        NcclP2PGroup(spec, 0, dist.HashStore(), torch.device("cpu"),
                     make_comm=lambda *a: _RecordedComm(*a, disabled=True), mint_id=mint)


class _NeverDone:
    """A launched round's CUDA event that never completes (its peer is gone)."""

    def query(self):
        return False


def test_a_failed_nccl_peer_fails_the_round_at_once_naming_it():
    """N16: without torch's watchdog nobody else polls NCCL's asynchronous errors, so a
    round's wait does: when NCCL reports one (a peer died, its link failed) the wait fails
    within a poll, naming the round, the peer and the communicator — not at the deadline.
    (NCCL is stood in for: its error code is what `ncclCommGetAsyncError` would return.)"""
    spec = SyncGroupSpec("127.0.0.1", 1, "p/", 3, backend="nccl", actor_ranks=1)
    store = dist.HashStore()
    store.set("nccl/0", b"\x01" * 128)  # minted by sync rank 0
    code = [0]
    group = NcclP2PGroup(spec, 2, store, torch.device("cpu"), make_comm=_RecordedComm,
                         error_reader=lambda comm: lambda: code[0])
    group.events[0] = _NeverDone()
    assert group.async_error() is None
    threading.Timer(0.3, lambda: code.__setitem__(0, 6)).start()  # ncclRemoteError
    start = time.monotonic()
    with pytest.raises(SyncError, match=r"^weight sync failed at round 0: receive from training "
                                        r"rank 0 \(tp0\) after 0\.\d s: NCCL transfers of "
                                        r"round 0 failed: ncclRemoteError on the communicator "
                                        r"of sync ranks \[0, 1, 2\]"):
        wait_work(RoundWork(group, 0), "round 0: receive from training rank 0 (tp0)", 600.0)
    assert time.monotonic() - start < 5.0  # the deadline was 600 s


class QueuedGloo:
    """NcclP2PGroup's launch protocol over real gloo: ops wait until `launch_round`, and a
    work waited for before its round was launched raises."""

    def __init__(self, group):
        self.group, self.queue, self.launches = group, [], 0

    def send(self, tensors, dst, tag):
        return self._queue("send", tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._queue("recv", tensors, src, tag)

    def _queue(self, op, tensors, peer, tag):
        work = _Deferred()
        self.queue.append((op, tensors, peer, tag, work))
        return work

    def launch_round(self):
        for op, tensors, peer, tag, work in self.queue:
            work.work = getattr(self.group, op)(tensors, peer, tag)
        self.queue, self.launches = [], self.launches + 1


class _Deferred:
    work = None

    def wait(self, timeout=None):
        if self.work is None:
            raise RuntimeError("waited for before its round was launched")
        return self.work.wait(timeout)


def sync_through_launched_rounds(rank, world_size):
    spec = get_preset("micro")
    src, dst = megatron_shards(spec, ParallelConfig(tp=2)), vllm_shards(spec, 2, 1)
    plan = build_plan(src, dst, bucket_bytes=64 << 10)
    g = torch.Generator().manual_seed(3)
    hf = {n: torch.randn(s, generator=g) for n, s in hf_shards(spec).hf_shapes.items()}
    group = join_sync_group(SyncGroupSpec("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]),
                                          "q/", plan.world_size, timeout_s=30.0), rank)
    queued = QueuedGloo(group)
    copy = P2PCopy(queued, wire_device="cpu")
    if rank < plan.num_src:
        send_shards(plan, group, rank, materialize_rank(src, rank, hf.__getitem__),
                    dtype=torch.float32, copy=copy)
        return {"launches": queued.launches, "rounds": len(plan.rounds)}
    got = dict(receive_shards(plan, group, rank, dtype=torch.float32, copy=copy))
    want = materialize_rank(dst, rank - plan.num_src, hf.__getitem__)
    return {"launches": queued.launches, "rounds": len(plan.rounds),
            "exact": set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)}


def test_p2p_copy_launches_every_round_it_posts():
    results = run_on_ranks(sync_through_launched_rounds, 4, timeout_s=120,
                           init_default_group=False)
    assert all(r["exact"] for r in results[2:])
    for r in results:
        assert r["rounds"] > 2 and 0 < r["launches"] <= r["rounds"]


def test_an_nccl_sync_group_carries_its_bytes_on_pynccl_not_on_processgroupnccl(monkeypatch):
    """B7: SyncChannels on an NCCL spec joins vLLM's communicators (stood in by a recorder:
    no NCCL here) and a gloo control group — never torch's ProcessGroupNCCL, whose watchdog
    kills the process on a timeout or a dead peer."""
    from mcore_rl.resharding import channels, host_store, nccl_group

    def no_watchdog_groups(*args, **kwargs):
        raise AssertionError("ProcessGroupNCCL built for the weight sync")

    monkeypatch.setattr(dist, "ProcessGroupNCCL", no_watchdog_groups, raising=False)
    monkeypatch.setattr(nccl_group, "_pynccl_comm", _RecordedComm)
    monkeypatch.setattr(nccl_group, "_new_unique_id", lambda: b"\x07" * 128)
    store = host_store("127.0.0.1", world_size=2, timeout_s=20)
    spec = SyncGroupSpec("127.0.0.1", store.port, "b7/", 2, timeout_s=20.0, backend="nccl",
                         actor_ranks=1)
    joined, errors = {}, []

    def join(rank):
        try:
            joined[rank] = channels.SyncChannels.join(spec, rank, "cpu",
                                                      store if rank == 0 else None)
        except Exception as err:  # noqa: BLE001 — reported below
            errors.append(err)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for rank, ch in joined.items():
        assert isinstance(ch.bulk, NcclP2PGroup)
        assert ch.bulk.comms[0].args == (b"\x07" * 128, rank, 2, "cpu")
        assert isinstance(ch.control, dist.ProcessGroupGloo)  # the control group beside it
    assert isinstance(P2PCopy(joined[0].bulk)._launch, type(joined[0].bulk.launch_round))
