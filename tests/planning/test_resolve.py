"""The resolved run: one pure decision of device, layer spec, sync backend and transports."""

from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.planning.resolve import resolve_run
from mcore_rl.trainer.rl_config import RLConfig

CONFIGS = Path(__file__).parents[2] / "configs"


def _load(path, *overrides):
    return load_config(RLConfig, path, list(overrides))


def test_cpu_config_resolves_to_gloo_local_p2p():
    run = resolve_run(_load(CONFIGS / "tiny_ci.yaml"), cuda_available=False)
    assert (run.device, run.layer_spec, run.sync_backend) == ("cpu", "local", "gloo")
    assert set(run.transports) == {"p2p"}
    assert set(run.actor_devices) == {"cpu"}


def test_local_cluster_assumed_gpu_resolves_to_nccl_te():
    run = resolve_run(_load(CONFIGS / "tiny_ci.yaml"), assume_gpu=True, cuda_available=False)
    assert (run.device, run.layer_spec, run.sync_backend) == ("cuda", "te", "nccl")
    # disaggregated on one node: every rank its own device
    devices = list(run.actor_devices) + [d for e in run.engine_devices for d in e]
    assert len(set(devices)) == len(devices)


@pytest.mark.parametrize("name,transport", [("llama3-70b", "p2p"), ("llama3-8b", "ipc")])
def test_gpu_configs_resolve_their_transports(name, transport):
    run = resolve_run(_load(CONFIGS / "gpu" / f"{name}.yaml"), cuda_available=False)
    assert (run.device, run.layer_spec, run.sync_backend) == ("cuda", "te", "nccl")
    assert set(run.transports) == {transport}
    assert run.summary()["transports"] == [transport] * len(run.engine_devices)


def test_resolved_cluster_is_the_allocation_as_sized():
    """A gpu/cpu cluster as written (its sync backend resolved); a local one as this machine:
    one node of exactly the devices the placement uses."""
    gpu = resolve_run(_load(CONFIGS / "gpu" / "llama3-70b.yaml"), cuda_available=False)
    assert (gpu.cluster.device, gpu.cluster.nodes, gpu.cluster.gpus_per_node) == ("gpu", 8, 8)
    assert gpu.placement.nodes == gpu.cluster.nodes and gpu.summary()["nodes"] == 8
    local = resolve_run(_load(CONFIGS / "tiny_ci.yaml"), cuda_available=False)
    used = len(local.actor_devices) + sum(len(e) for e in local.engine_devices)
    assert (local.cluster.device, local.cluster.nodes, local.cluster.gpus_per_node) == (
        "cpu", 1, used)
    assert local.cluster.sync_backend == local.sync_backend == "gloo"


def test_configured_backend_is_kept_for_preflight_to_judge():
    """nccl asked for on a CPU run stays nccl here; preflight refuses it, naming the field."""
    run = resolve_run(_load(CONFIGS / "tiny_ci.yaml", "cluster.sync_backend=nccl"),
                      cuda_available=False)
    assert (run.device, run.sync_backend) == ("cpu", "nccl")


def test_vllm_expert_parallel_is_resolved_on_gpu_and_refused_on_cpu():
    a3b = CONFIGS / "gpu" / "qwen3-30b-a3b.yaml"
    assert not resolve_run(_load(a3b), cuda_available=False).expert_parallel
    run = resolve_run(_load(a3b, "rollout.expert_parallel=true"), cuda_available=False)
    assert run.expert_parallel and run.summary()["expert_parallel"] is True
    with pytest.raises(ConfigError, match=r"rollout.expert_parallel=True: the run resolves to "
                                          r"cpu: .*cpu_moe.py.*no expert-map argument"):
        resolve_run(_load(CONFIGS / "demo_moe.yaml", "rollout.expert_parallel=true"),
                    cuda_available=False)
