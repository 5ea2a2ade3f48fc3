"""Placement plans: which device holds every actor rank and engine TP rank."""

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.launch.placement import Slot, plan_placement

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.mark.parametrize("world,tp,engines,per_node,placement,actor,engine_slots", [
    # colocated, one node: actor rank d and engine rank d share device d
    (2, 2, 1, 2, "colocated", [(0, 0), (0, 1)], [[(0, 0), (0, 1)]]),
    # colocated over two nodes, TP1 engines: one engine per device
    (4, 1, 4, 2, "colocated", [(0, 0), (0, 1), (1, 0), (1, 1)],
     [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]),
    # disaggregated: engines after the actor's devices
    (2, 1, 2, 4, "disaggregated", [(0, 0), (0, 1)], [[(0, 2)], [(0, 3)]]),
    # disaggregated, an odd actor world: the TP2 engine starts on an aligned device so it
    # does not straddle the node boundary
    (3, 2, 1, 4, "disaggregated", [(0, 0), (0, 1), (0, 2)], [[(1, 0), (1, 1)]]),
    # 70B shape: TP8·PP4 actor on 4 nodes, 4 TP8 engines on the next 4
    (32, 8, 4, 8, "disaggregated", [(r // 8, r % 8) for r in range(32)],
     [[(4 + e, t) for t in range(8)] for e in range(4)]),
])
def test_plan_placement(world, tp, engines, per_node, placement, actor, engine_slots):
    plan = plan_placement(actor_world=world, engine_tp=tp, engines=engines,
                          devices_per_node=per_node, placement=placement)
    assert plan.actor == tuple(Slot(*a) for a in actor)
    assert plan.engines == tuple(tuple(Slot(*s) for s in e) for e in engine_slots)
    shared = plan.shared_devices()
    assert shared == (world if placement == "colocated" else 0)


@pytest.mark.parametrize("kwargs,field", [
    (dict(actor_world=4, engine_tp=1, engines=2, devices_per_node=4, placement="colocated"),
     "rollout.engines"),  # colocated needs one engine rank per actor device
    (dict(actor_world=4, engine_tp=3, engines=1, devices_per_node=4, placement="disaggregated"),
     "rollout.tp"),  # an engine cannot span nodes
    (dict(actor_world=4, engine_tp=1, engines=1, devices_per_node=4, placement="spread"),
     "cluster.placement"),
])
def test_plan_placement_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        plan_placement(**kwargs)


@pytest.mark.parametrize("name", ["llama3-8b", "llama2-13b", "llama3-70b"])
def test_shipped_gpu_configs_place_on_their_nodes(name):
    """Each GPU config's placement uses exactly the nodes its cluster section asks for."""
    from pathlib import Path

    from mcore_rl.config import load_config
    from mcore_rl.runconfig.resolve import placement_plan_of
    from mcore_rl.runconfig import RLConfig

    cfg = load_config(RLConfig, Path(__file__).parents[2] / "configs" / "gpu" / f"{name}.yaml")
    plan = placement_plan_of(cfg)
    assert plan.nodes == cfg.cluster.nodes
    devices = set(plan.actor) | {s for e in plan.engines for s in e}
    assert all(s.device < cfg.cluster.gpus_per_node for s in devices)
    expected = cfg.actor.world_size + (0 if cfg.cluster.placement == "colocated"
                                       else cfg.rollout.tp * cfg.rollout.engines)
    assert len(devices) == expected  # no device holds two ranks of one role


@pytest.mark.parametrize("visible,slots,narrowed", [
    (None, [2, 3], "2,3"),          # the node exposes 0..n-1: the slots are the ids
    ("4,5,6,7", [2, 3], "6,7"),     # already narrowed (e.g. by SLURM): index into it
    ("GPU-a,GPU-b", [1], "GPU-b"),  # UUIDs pass through
])
def test_visible_devices_are_narrowed_before_cuda_starts(monkeypatch, visible, slots, narrowed):
    """C1: narrowing CUDA_VISIBLE_DEVICES after anything in the process asked torch about CUDA
    is too late (the CUDA runtime read the variable already). The narrowing reads the
    environment alone: any torch.cuda query here fails the test."""
    import torch

    from mcore_rl.launch.placement import restrict_visible_devices

    def cuda_touched(*args, **kwargs):
        raise AssertionError("torch.cuda was queried before CUDA_VISIBLE_DEVICES was narrowed")

    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device"):
        monkeypatch.setattr(torch.cuda, name, cuda_touched)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert restrict_visible_devices(slots) == narrowed
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == narrowed


def test_engines_on_gpu_keep_ray_off_their_visible_devices():
    """Ray must not rewrite CUDA_VISIBLE_DEVICES in an engine actor we narrow ourselves (vLLM
    sets the same variable in its Ray executor)."""
    from mcore_rl.launch.placement import RAY_NOSET_VISIBLE_DEVICES

    assert RAY_NOSET_VISIBLE_DEVICES == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def test_narrowing_refuses_slots_the_node_does_not_expose(monkeypatch):
    from mcore_rl.launch.placement import restrict_visible_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match=r"local devices \[2\] not all among"):
        restrict_visible_devices([2])
