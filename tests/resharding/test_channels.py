"""A rank's sync channels on real gloo ranks: the plan check before bytes move.

Every rank compares plan fingerprints before the first sync of a plan in a group, and a plan
the group's ranks already agreed on is not compared again (one collective less per sync);
ranks given different plans are still named, on every rank.
"""

import os

import pytest

from mcore_rl.launch.spawn import run_on_ranks
from mcore_rl.layouts import megatron_shards, vllm_shards
from mcore_rl.models.presets import get_preset
from mcore_rl.parallel import ParallelConfig
from mcore_rl.resharding import SyncError, SyncGroupSpec, build_plan

MICRO = get_preset("micro")


def _plan(bucket_kib: int):
    return build_plan(megatron_shards(MICRO, ParallelConfig(tp=2)), vllm_shards(MICRO, 1, 1),
                      bucket_bytes=bucket_kib << 10)


def verify_sequence(rank, world_size):
    """Each rank verifies: plan A twice, then a plan that differs on rank 1, then plan D, then
    plan E that the inference rank (sync rank 2) refuses (its parameters do not match).
    Returns the fingerprint exchanges each call made, the errors raised and how long the
    refused check took."""
    import time

    import mcore_rl.resharding.channels as channels_module
    from mcore_rl.resharding.channels import SyncChannels

    exchanges = []
    real = channels_module.verify_plan

    def counted(*args, **kwargs):
        exchanges.append(1)
        return real(*args, **kwargs)

    channels_module.verify_plan = counted
    spec = SyncGroupSpec("127.0.0.1", int(os.environ["MCORE_RL_STORE_PORT"]), "verify/",
                         world_size, timeout_s=30.0)
    channels = SyncChannels.join(spec, rank)
    out = {"exchanges": [], "errors": []}
    differing = _plan(16) if rank == 1 else _plan(32)
    refusal = "model.norm.weight: plan (64,) vs vLLM (128,)" if rank == 2 else None
    try:
        for plan in (_plan(64), _plan(64), differing, _plan(128), _plan(256)):
            before, start = len(exchanges), time.monotonic()
            try:
                channels.verify(plan, refusal if plan.bucket_bytes == 256 << 10 else None)
            except SyncError as err:
                out["errors"].append(str(err))
            out["exchanges"].append(len(exchanges) - before)
            out["seconds"] = time.monotonic() - start
    finally:
        channels.close()
    return out


@pytest.mark.timeout(180)
def test_a_plan_is_compared_once_per_group_and_a_differing_rank_is_named():
    assert _plan(64).world_size == 3
    outs = run_on_ranks(verify_sequence, 3, init_default_group=False)
    for rank, out in enumerate(outs):
        # A compared, A again not (agreed on), the differing plans compared, D compared, E
        assert out["exchanges"] == [1, 0, 1, 1, 1], (rank, out)
        assert len(out["errors"]) == 2, (rank, out)
        # each rank names the ranks whose plan differs from its own
        named = out["errors"][0]
        assert f"sync rank {rank}: the resharding plan differs on" in named
        if rank == 1:
            assert "training rank 0" in named and "inference rank 0" in named
        else:
            assert "training rank 1" in named and "inference rank" not in named
        # N6: the rank whose parameters do not fit E still joins the check, so every rank
        # fails at once naming it and the tensor — not at the group's 30 s deadline
        assert out["errors"][1] == (f"sync rank {rank}: the plan does not fit inference rank "
                                    "0 (engine0 tp0): model.norm.weight: plan (64,) vs vLLM "
                                    "(128,)"), out
        assert out["seconds"] < 10, out


def test_fingerprints_travel_on_the_gloo_control_group_beside_nccl(monkeypatch):
    """Issue #30, S1: comparing fingerprints on an NCCL sync group builds a communicator over
    the whole world (one more NCCL init on every rank). Beside a non-gloo group every rank
    joins a gloo control group, with or without IPC engines, and the fingerprints go there."""
    import torch

    import mcore_rl.resharding.channels as channels_module
    from mcore_rl.resharding.channels import SyncChannels

    p2p_only = SyncGroupSpec("127.0.0.1", 1, "fp/", 3, backend="nccl", transports=("p2p",))
    assert p2p_only.needs_control_group
    assert not SyncGroupSpec("127.0.0.1", 1, "fp/", 3, backend="gloo").needs_control_group
    seen = []
    monkeypatch.setattr(channels_module, "verify_plan",
                        lambda plan, group, rank, **kw: seen.append((group, kw)))
    bulk, control = object(), object()  # stand for the NCCL group and its gloo companion
    SyncChannels(p2p_only, 0, torch.device("cpu"), bulk, control).verify(_plan(64))
    assert seen == [(control, {"device": "cpu", "problem": None})]
