"""Defect 1 of issue #12: the sync group's backend is the resolved run's, so a GPU run's
`sync.backend: nccl` reaches the group the controller builds (it used to be gloo
always). No Ray, no workers: the weight sync's own join step runs against stub engines and
actor ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_rl.config import load_config
from mcore_rl.runconfig.resolve import resolve_run
from mcore_rl.resharding import SyncGroupSpec, sync_group_spec
from mcore_rl.resharding.plan_cache import PlanSender
from mcore_rl.rl.weight_sync import WeightSync
from mcore_rl.runconfig import RLConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CASES = [
    # config, assume a GPU machine, backend the group must carry
    ("gpu/llama3-70b.yaml", False, "nccl"),   # sync.backend: nccl (disaggregated)
    ("gpu/llama3-8b.yaml", False, "nccl"),    # colocated
    ("tiny_ci.yaml", True, "nccl"),           # local cluster on an (assumed) GPU machine
    ("tiny_ci.yaml", False, "gloo"),          # local cluster on this CPU machine
]


class _Worker:
    """An actor rank's join call, recorded (stands in for the Ray handle's .remote)."""

    def __init__(self, calls: list):
        self.join_sync_group = self
        self.calls = calls

    def remote(self, spec, device):
        self.calls.append((spec, device))
        return spec


class _Actors:
    """ActorRanks' handles and wait (the refs are the results here)."""

    def __init__(self, workers: list):
        self.workers = workers

    def wait(self, refs, phase):
        return refs


class _Engines:
    def __init__(self, num_engines: int):
        self.specs: list[SyncGroupSpec] = []
        self.num_engines = num_engines  # RayEngines': the engines in the run (all, here)

    def start_join_sync_group(self, spec, first_rank, devices=None, plan=None):
        self.specs.append(spec)
        self.devices, self.plan = devices, plan

    def finish_join_sync_group(self):
        pass


class _Plan:
    def fingerprint(self) -> bytes:
        return b"plan"


@pytest.mark.parametrize("name,assume_gpu,backend", CASES)
def test_controller_builds_the_sync_group_of_the_resolved_run(name, assume_gpu, backend):
    cfg = load_config(RLConfig, CONFIGS / name)
    run = resolve_run(cfg, assume_gpu=assume_gpu, cuda_available=False)
    sync = object.__new__(WeightSync)  # its join step only; no plan, no workers
    sync.cfg, sync.run, sync.host = cfg, run, "127.0.0.1"
    sync.engines = _Engines(cfg.rollout.engines)
    to_actors: list = []
    sync.actors = _Actors([_Worker(to_actors) for _ in range(cfg.actor.world_size)])
    sync.groups_formed = 0  # the first group of the run
    sync.plan = _Plan()
    sync._plan_sender = PlanSender(sync.plan)
    sync._adapter_sender = None  # no LoRA adapter sync
    sync.join_group()
    (spec,) = sync.engines.specs
    # actor ranks and engines join the same group, each rank on its resolved device
    assert to_actors == [(spec, device) for device in run.actor_devices]
    assert sync.engines.devices == run.engine_devices
    assert sync.engines.plan is sync.plan  # each engine rank checks it covers its parameters
    assert spec.transports == run.transports
    assert spec.backend == backend == run.sync_backend
    assert spec.world_size == cfg.actor.world_size + cfg.rollout.tp * cfg.rollout.engines
    assert spec.timeout_s == cfg.deadlines.sync_s
    sync._store = None  # the TCPStore it hosted


def test_sync_group_spec_reads_only_the_resolved_run():
    cfg = load_config(RLConfig, CONFIGS / "gpu" / "llama3-70b.yaml")
    run = resolve_run(cfg, cuda_available=False)
    spec = sync_group_spec(run, host="10.0.0.1", port=5, prefix="sync/", timeout_s=9.0)
    assert spec == SyncGroupSpec("10.0.0.1", 5, "sync/", 64, 9.0, backend="nccl",
                                 transports=run.transports, nodes=run.sync_nodes(),
                                 actor_ranks=32)
    assert spec.nodes == tuple([r // 8 for r in range(32)] + [4 + r // 8 for r in range(32)])
