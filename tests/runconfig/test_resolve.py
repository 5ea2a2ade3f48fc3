"""The resolved run: one pure decision of device, layer spec, sync backend and transports."""

from pathlib import Path

import pytest

from mcore_rl.config import ConfigError, load_config
from mcore_rl.runconfig.resolve import resolve_run
from mcore_rl.runconfig import RLConfig

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

CONFIGS = Path(__file__).parents[2] / "configs"


def _load(path, *overrides):
    return load_config(RLConfig, path, list(overrides))


def test_cpu_config_resolves_to_gloo_local_p2p():
    run = resolve_run(_load(CONFIGS / "tiny_ci.yaml"), cuda_available=False)
    assert (run.device, run.layer_spec, run.sync_backend) == ("cpu", "local", "gloo")
    assert not run.release_trainer_cache  # no CUDA allocator to release
    assert set(run.transports) == {"p2p"}
    assert set(run.actor_devices) == {"cpu"}


def test_local_cluster_assumed_gpu_resolves_to_nccl_te():
    run = resolve_run(_load(CONFIGS / "tiny_ci.yaml"), assume_gpu=True, cuda_available=False)
    assert (run.device, run.layer_spec, run.sync_backend) == ("cuda", "te", "nccl")
    # disaggregated on one node: every rank its own device (engines: their physical slots)
    slots = [s.device for s in run.placement.actor] + [
        d for e in run.engine_visible_devices for d in e]
    assert len(set(slots)) == len(slots)


@pytest.mark.parametrize("name,transport", [("llama3-70b", "p2p"), ("llama3-8b", "ipc")])
def test_gpu_configs_resolve_their_transports(name, transport):
    run = resolve_run(_load(CONFIGS / "gpu" / f"{name}.yaml"), cuda_available=False)
    assert (run.device, run.layer_spec, run.sync_backend) == ("cuda", "te", "nccl")
    assert set(run.transports) == {transport}
    assert run.summary()["transports"] == [transport] * len(run.engine_devices)
    # N4: trainers sharing GPUs with engines give their cached activation peak back
    assert run.release_trainer_cache is (transport == "ipc")


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
    assert local.sync_backend == "gloo"


def test_configured_backend_is_kept_for_preflight_to_judge():
    """nccl asked for on a CPU run stays nccl here; preflight refuses it, naming the field."""
    run = resolve_run(_load(CONFIGS / "tiny_ci.yaml", "sync.backend=nccl"),
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


# the GPU configs, and a 2-node colocated 70B plan (each engine on one node, the actor's
# pipeline stages on both)
GPU_RUNS = [(p.name, ()) for p in sorted((CONFIGS / "gpu").glob("*.yaml"))] + [
    ("llama3-70b.yaml", ("cluster.nodes=2", "cluster.placement=colocated", "actor.pp=2",
                         "rollout.engines=2", "rollout.enable_sleep=true"))]


@pytest.mark.parametrize("name,overrides", GPU_RUNS)
def test_engine_workers_get_process_local_devices(name, overrides):
    """B1: an engine narrows CUDA_VISIBLE_DEVICES to its physical slots, so inside it TP rank
    t is cuda:t (vLLM's worker device, vllm/v1/worker/gpu_worker.py). The resolved run hands
    every engine worker cuda:0..tp-1 and keeps the physical slots for the narrowing — an
    engine worker given cuda:<node slot> fails with "invalid device ordinal" on every engine
    after a node's first."""
    run = resolve_run(_load(CONFIGS / "gpu" / name, *overrides), cuda_available=False)
    for e, (slots, devices) in enumerate(zip(run.placement.engines, run.engine_devices)):
        assert list(devices) == [f"cuda:{t}" for t in range(len(slots))], (e, devices)
    from mcore_rl.rollout.install import worker_device

    for slots, devices, visible in zip(run.placement.engines, run.engine_devices,
                                       run.engine_visible_devices):
        assert list(visible) == [s.device for s in slots]
        for t, device in enumerate(devices):  # what vLLM's TP rank t holds in that process
            assert worker_device(device, f"cuda:{t}", t) == f"cuda:{t}"
    # actor ranks see their node's devices: their slot
    assert list(run.actor_devices) == [f"cuda:{s.device}" for s in run.placement.actor]
    summary = run.summary()
    assert summary["engine_visible_devices"] == [list(v) for v in run.engine_visible_devices]


def test_worker_device_refuses_a_resolved_device_it_does_not_hold():
    from mcore_rl.rollout.install import worker_device

    assert worker_device("cpu", None, 0) == "cpu"
    with pytest.raises(RuntimeError, match=r"gives it cuda:2, but vLLM's worker holds cuda:0"):
        worker_device("cuda:2", "cuda:0", 0)
    with pytest.raises(RuntimeError, match=r"gives it cpu, but vLLM's worker holds cuda:0"):
        worker_device("cpu", "cuda:0", 0)


@pytest.mark.parametrize("name", ["llama3-8b.yaml", "qwen3-30b-a3b.yaml"])
def test_colocated_engine_ranks_read_their_own_gpus_trainer_first(name):
    """N13: on a colocated GPU run every sync rank's device is part of the plan
    (`sync_devices`), and a region an engine rank needs comes from the trainer on its own
    GPU whenever that trainer holds it — not from a DP replica on another GPU of the node
    (a peer mapping). None on the host."""
    from mcore_rl.layouts import megatron_shards, vllm_shards
    from mcore_rl.planning.sized import resolve_model
    from mcore_rl.planning.sync_traffic import sync_plan
    from mcore_rl.resharding import build_plan

    cfg = _load(CONFIGS / "gpu" / name)
    run = resolve_run(cfg, cuda_available=False)
    nodes, devices = run.sync_nodes(), run.sync_devices()
    assert devices is not None and len(devices) == len(nodes)
    spec = resolve_model(cfg.model.planning_model())
    plan = sync_plan(cfg, run, spec)

    def same_device_bytes(p):
        return sum(t.numel * p.element_size for rnd in p.rounds for t in rnd
                   if (nodes[t.src_rank], devices[t.src_rank])
                   == (nodes[t.dst_rank], devices[t.dst_rank]))

    blind = build_plan(megatron_shards(spec, cfg.actor, layer_spec=run.layer_spec),
                       vllm_shards(spec, cfg.rollout.tp, len(run.engine_devices),
                                   expert_parallel=run.expert_parallel),
                       bucket_bytes=plan.bucket_bytes, element_size=plan.element_size,
                       nodes=nodes)
    assert same_device_bytes(plan) > same_device_bytes(blind)
    assert plan.bytes_received() == blind.bytes_received()
    cpu = resolve_run(_load(CONFIGS / "tiny_ci.yaml"), cuda_available=False)
    assert cpu.sync_devices() is None


@pytest.mark.parametrize("name,overrides", GPU_RUNS)
def test_ipc_never_crosses_a_node(name, overrides):
    """B2: an "ipc" engine receives by IPC only from its own node; the rest of what it needs
    comes over the network, and a same-node replica is taken whenever one holds a region.
    On the audit's figures: qwen3-30b-a3b 114 of 228 GiB and the 2-node 70B 131 of 263 GiB
    came from the other node through IPC handles that cannot be opened there."""
    from mcore_rl.planning.sized import resolve_model
    from mcore_rl.planning.sync_traffic import sync_plan, sync_traffic
    from mcore_rl.resharding.sync_group import sync_group_spec

    cfg = _load(CONFIGS / "gpu" / name, *overrides)
    run = resolve_run(cfg, cuda_available=False)
    plan = sync_plan(cfg, run, resolve_model(cfg.model.planning_model()))
    spec = sync_group_spec(run, host="", port=0, prefix="", timeout_s=1.0)
    nodes = run.sync_nodes()
    pairs = {(t.src_rank, t.dst_rank) for rnd in plan.rounds for t in rnd}
    for src, dst in pairs:
        if spec.pair_transport(plan, src, dst) == "ipc":
            assert nodes[src] == nodes[dst], (src, dst)
    traffic = sync_traffic(run, plan)
    assert traffic["cross_node_ipc_bytes"] == 0
    total = sum(plan.bytes_received().values())
    assert traffic["ipc_bytes"] + traffic["p2p_bytes"] == total
    if "ipc" in run.transports:
        assert traffic["ipc_bytes"] > 0
    if len(set(nodes)) == 1:
        assert traffic["network_bytes"] == 0
    if name == "qwen3-30b-a3b.yaml" or overrides:  # colocated on 2 nodes: half of it can
        # only come from the other node's pipeline stage — over the network now
        assert traffic["network_bytes"] == traffic["p2p_bytes"] > 0


@pytest.mark.parametrize("name,overrides", GPU_RUNS)
def test_trainers_are_built_before_engines_start_on_shared_devices(name, overrides):
    """B6: vLLM sizes itself against the free memory it measures at start-up and asserts that
    no other process frees memory while it profiles (vllm/v1/worker/utils.py request_memory,
    gpu_worker.py determine_available_memory), so trainers still allocating on the same
    devices fail its start. Where devices are shared the run builds the trainers first;
    disaggregated runs start both at once."""
    cfg = _load(CONFIGS / "gpu" / name, *overrides)
    run = resolve_run(cfg, cuda_available=False)
    shared = {s for e in run.placement.engines for s in e} & set(run.placement.actor)
    assert run.trainers_first is bool(shared)
    assert run.trainers_first is (cfg.cluster.placement == "colocated")
    assert run.summary()["trainers_first"] is run.trainers_first


def test_a_cpu_colocated_run_follows_the_gpu_start_up_order():
    """The CPU twin of B6: the colocated CPU controller test starts the same way."""
    run = resolve_run(_load(CONFIGS / "tiny_ci.yaml", "cluster.device=cpu",
                            "cluster.gpus_per_node=2", "cluster.device_gib=8",
                            "cluster.reserve_gib=0", "cluster.placement=colocated",
                            "actor.tp=2", "rollout.engines=2", "rollout.enable_sleep=true"),
                     cuda_available=False)
    assert run.trainers_first
    assert not resolve_run(_load(CONFIGS / "tiny_ci.yaml"), cuda_available=False).trainers_first


@pytest.mark.parametrize("name,overrides", GPU_RUNS)
def test_gpu_runs_sync_in_large_buckets(name, overrides):
    """S1: on GPU every transfer round is a group of NCCL launches; the plan's default bucket
    there is 512 MB (16 MB on CPU), and a configured one is kept. The plan explain reports is
    cut with it: fewer rounds than at the CPU default."""
    from mcore_rl.planning.sized import sized_run
    from mcore_rl.planning.sync_traffic import sync_plan

    cfg = _load(CONFIGS / "gpu" / name, *overrides)
    run = resolve_run(cfg, cuda_available=False)
    assert run.sync_bucket_mb == 512.0 and run.summary()["sync_bucket_mb"] == 512.0
    spec = sized_run(cfg, cuda_available=False).spec
    small = resolve_run(_load(CONFIGS / "gpu" / name, *overrides, "sync.bucket_mb=16"),
                        cuda_available=False)
    assert small.sync_bucket_mb == 16.0
    assert len(sync_plan(cfg, run, spec).rounds) < len(sync_plan(cfg, small, spec).rounds)


def test_cpu_runs_keep_small_buckets_and_a_bad_bucket_is_refused():
    assert resolve_run(_load(CONFIGS / "tiny_ci.yaml"), cuda_available=False).sync_bucket_mb == 16
    with pytest.raises(ConfigError, match="sync.bucket_mb=0"):
        _load(CONFIGS / "tiny_ci.yaml", "sync.bucket_mb=0")


@pytest.mark.parametrize("name,overrides", GPU_RUNS)
def test_gpu_engines_capture_cuda_graphs_and_sleep_at_level_2(name, overrides):
    """S2: on GPU the plan runs the engines with CUDA graphs (enforce_eager false) and, where
    they sleep, at level 2: the weights are discarded rather than copied to the host, since
    the sync that follows overwrites every one. A configured value is kept."""
    run = resolve_run(_load(CONFIGS / "gpu" / name, *overrides), cuda_available=False)
    assert (run.enforce_eager, run.sleep_level) == (False, 2)
    assert run.summary()["enforce_eager"] is False and run.summary()["sleep_level"] == 2
    kept = resolve_run(_load(CONFIGS / "gpu" / name, *overrides, "rollout.enforce_eager=true",
                             "rollout.sleep_level=1"), cuda_available=False)
    assert (kept.enforce_eager, kept.sleep_level) == (True, 1)
    engine_cfg = run.engine_config(_load(CONFIGS / "gpu" / name, *overrides).rollout)
    assert (engine_cfg.enforce_eager, engine_cfg.sleep_level) == (False, 2)


def test_cpu_engines_run_eager_and_cuda_graphs_on_cpu_are_refused():
    cfg = _load(CONFIGS / "tiny_ci.yaml")
    run = resolve_run(cfg, cuda_available=False)
    assert run.enforce_eager is True
    assert run.engine_config(cfg.rollout).enforce_eager is True
    with pytest.raises(ConfigError, match=r"rollout.enforce_eager=False: CUDA graphs need a "
                                          r"GPU run"):
        resolve_run(_load(CONFIGS / "tiny_ci.yaml", "rollout.enforce_eager=false"),
                    cuda_available=False)


@pytest.mark.parametrize("name,overrides", GPU_RUNS)
def test_gpu_trainers_fuse_kernels_and_overlap_the_grad_reduce(name, overrides):
    """S3: on GPU (te layer spec) the trainers use TransformerEngine's fused RoPE and fused
    weight-grad accumulation, and overlap the DP grad reduction with the backward where
    dp > 1; a configured value is kept."""
    cfg = _load(CONFIGS / "gpu" / name, *overrides)
    run = resolve_run(cfg, cuda_available=False)
    assert run.fused_kernels is True
    assert run.overlap_grad_reduce is (cfg.actor.dp > 1)
    off = resolve_run(_load(CONFIGS / "gpu" / name, *overrides, "train.fused_kernels=false",
                            "train.overlap_grad_reduce=false"), cuda_available=False)
    assert (off.fused_kernels, off.overlap_grad_reduce) == (False, False)
    # megatron's torch.compile'd fusions: never by default, on when asked
    assert run.compiled_fusions is False
    asked = resolve_run(_load(CONFIGS / "gpu" / name, *overrides, "train.compile=true"),
                        cuda_available=False)
    assert asked.compiled_fusions is True


def test_cpu_trainers_run_unfused_and_fused_kernels_on_cpu_are_refused():
    run = resolve_run(_load(CONFIGS / "tiny_ci.yaml"), cuda_available=False)
    assert (run.fused_kernels, run.overlap_grad_reduce) == (False, False)
    overlap = resolve_run(_load(CONFIGS / "tiny_ci.yaml", "train.overlap_grad_reduce=true"),
                          cuda_available=False)
    assert overlap.overlap_grad_reduce is True  # it runs on gloo too
    with pytest.raises(ConfigError, match=r"train.fused_kernels=True: needs TransformerEngine"):
        resolve_run(_load(CONFIGS / "tiny_ci.yaml", "train.fused_kernels=true"),
                    cuda_available=False)


def test_late_engines_on_the_trainers_gpus_are_refused():
    """N3: late engines start while step 1 trains; colocated on GPU they would start vLLM
    beside a training trainer (the race `trainers_first` avoids at start-up). Refused naming
    the field; disaggregated GPU engines and CPU runs keep them."""
    colocated = _load(CONFIGS / "gpu" / "llama3-8b.yaml", "rollout.startup_engines=2")
    with pytest.raises(ConfigError, match=r"rollout.startup_engines=2: 2 engines would start "
                                          r"vLLM on GPUs the trainer is training on"):
        resolve_run(colocated, cuda_available=False)
    resolve_run(_load(CONFIGS / "gpu" / "llama3-8b.yaml", "rollout.startup_engines=null"),
                cuda_available=False)
    apart = _load(CONFIGS / "gpu" / "llama3-70b.yaml", "rollout.startup_engines=1")
    assert set(resolve_run(apart, cuda_available=False).transports) == {"p2p"}
    cpu = _load(CONFIGS / "tiny_ci.yaml", "rollout.engines=2", "rollout.startup_engines=1")
    assert resolve_run(cpu, cuda_available=False).device == "cpu"
