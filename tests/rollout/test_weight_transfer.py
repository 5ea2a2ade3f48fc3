"""The shard-only sync as a vLLM weight-transfer backend: the entry point every vLLM process
loads, the backend vLLM builds, and what it joins the sync group on (the worker's own device,
whatever the run plan's devices say). Live engines sync through it in test_engine_tp1/tp2."""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.rollout.config import RolloutConfig
from mcore_rl.rollout.engine import RolloutEngine
from mcore_rl.rollout.errors import RolloutError
from mcore_rl.rollout.vllm_plugin import BACKEND, PLUGIN_GROUP, register



def _engine(device: str, worker_rank: int):
    from mcore_rl.rollout.weight_transfer import ShardTransferEngine  # imports vLLM

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(rank=worker_rank),
                                  model_config=None)
    return ShardTransferEngine(SimpleNamespace(backend=BACKEND), vllm_config,
                               torch.device(device), torch.nn.Linear(2, 2))


def test_the_entry_point_registers_the_backend_once_per_process():
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_plugins_by_group

    from mcore_rl.rollout.weight_transfer import ShardTransferEngine

    points = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == BACKEND]
    assert [ep.value for ep in points] == ["mcore_rl.rollout.vllm_plugin:register"]
    assert load_plugins_by_group(PLUGIN_GROUP)[BACKEND] is register  # what vLLM runs
    register()
    register()  # vLLM may load general plugins again in one process
    engine = WeightTransferEngineFactory.create_engine(
        SimpleNamespace(backend=BACKEND),
        SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None),
        torch.device("cpu"), torch.nn.Linear(2, 2))
    assert isinstance(engine, ShardTransferEngine)


def test_it_joins_on_the_device_vllm_gave_the_worker(monkeypatch):
    """B1 by construction: TP rank 1 of an engine whose CUDA_VISIBLE_DEVICES is narrowed holds
    cuda:1 (vLLM's `Worker.device`); that is where it joins. A plan that addresses the node's
    physical index (cuda:5) is refused, naming both, and recorded — not raised into vLLM."""
    from mcore_rl.rollout import weight_transfer

    joined = []
    monkeypatch.setattr(weight_transfer.SyncChannels, "join",
                        lambda spec, rank, device: joined.append((rank, device)) or "group")
    engine = _engine("cuda:1", worker_rank=1)
    engine.init_transfer_engine(engine.parse_init_info(
        {"spec": "spec", "first_sync_rank": 4, "devices": ("cuda:0", "cuda:1")}))
    assert joined == [(5, "cuda:1")]
    assert engine.outcomes["init"] == {"ok": True, "sync_rank": 5, "device": "cuda:1"}

    physical = _engine("cuda:1", worker_rank=1)
    physical.init_transfer_engine(physical.parse_init_info(
        {"spec": "spec", "first_sync_rank": 4, "devices": ("cuda:4", "cuda:5")}))
    outcome = physical.outcomes["init"]
    assert not outcome["ok"] and len(joined) == 1
    assert "gives it cuda:5, but vLLM's worker holds cuda:1" in outcome["err"]


def test_bad_calls_are_recorded_never_raised():
    """A raise inside a vLLM worker RPC would leave the other workers' replies queued; every
    call records its error for `weight_transfer_outcome` instead."""
    engine = _engine("cpu", worker_rank=0)
    engine.init_transfer_engine(engine.parse_init_info({"spec": "s", "nope": 1}))
    assert not engine.outcomes["init"]["ok"]
    assert "Invalid init_info" in engine.outcomes["init"]["err"]
    engine.start_weight_update()
    engine.update_weights({"plan": None})
    assert engine.outcomes["update"]["err"] == "RuntimeError: not in a sync group " \
                                               "(init_weight_transfer_engine first)"
    engine.update_weights({"plan": None, "colour": "red"})
    assert "Invalid update_info" in engine.outcomes["update"]["err"]
    engine.start_weight_update()  # a new update forgets the last one's outcome
    assert "update" not in engine.outcomes
    engine.finish_weight_update()
    engine.shutdown()


def test_an_engine_refuses_to_start_without_the_entry_point(monkeypatch, micro_dir):
    monkeypatch.setattr("mcore_rl.rollout.vllm_plugin.entry_point_installed", lambda: False)
    with pytest.raises(RolloutError, match=r"start-up: vLLM's workers cannot find mcore-rl's "
                                           r"weight-transfer backend.*scripts/setup.sh"):
        RolloutEngine(micro_dir, RolloutConfig(), call_timeout_s=10.0, device="cpu")
