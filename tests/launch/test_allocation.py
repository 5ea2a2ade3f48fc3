"""A SLURM allocation against the Ray bundles a run's placement reserves (`launch.allocation`,
N9): read from the variables SLURM sets, a shortfall is one line naming what the allocation
lacks, what the plan needs, and the sbatch options that fit it. Unit tests on the environment
SLURM would set; the real-SLURM runs are tests/launch/test_slurm.py's."""

from __future__ import annotations

import pytest

from mcore_rl.launch.allocation import SlurmAllocation, allocation_shortfall
from mcore_rl.launch.placement import node_bundles, plan_placement

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

# llama3-8b's plan: one node, 8 GPUs colocated, 4 engines × 1 CPU
COLOCATED = plan_placement(actor_world=8, engine_tp=2, engines=4, devices_per_node=8,
                           placement="colocated")


def _env(**values) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", **{k: str(v) for k, v in values.items()}}


def test_the_bundles_are_what_ray_placement_reserves():
    assert node_bundles(COLOCATED, cpus_per_engine=1.0, gpu=True) == [{"CPU": 4.0, "GPU": 8.0}]
    assert node_bundles(COLOCATED, cpus_per_engine=1.0, gpu=False) == [{"CPU": 4.0}]
    two = plan_placement(actor_world=8, engine_tp=8, engines=1, devices_per_node=8,
                         placement="disaggregated")
    # the trainer-only node still reserves one CPU
    assert node_bundles(two, cpus_per_engine=2.0, gpu=True) == [
        {"CPU": 1.0, "GPU": 8.0}, {"CPU": 2.0, "GPU": 8.0}]


def test_sbatch_defaults_name_the_missing_gpus_and_cpus_in_one_line():
    """train.sbatch's defaults (2 CPUs, no GPU request) against a GPU plan."""
    bundles = node_bundles(COLOCATED, cpus_per_engine=1.0, gpu=True)
    short = allocation_shortfall(bundles, SlurmAllocation.from_env(
        _env(SLURM_JOB_NUM_NODES=1, SLURM_CPUS_ON_NODE=2)))
    assert short is not None and "\n" not in short.lacks
    assert short.lacks == (
        "SLURM job 4242 has no GPUs (SLURM_GPUS_ON_NODE and SLURM_JOB_GPUS unset: no "
        "--gres=gpu:N) where the plan needs 8 per node; 2 CPU(s) per node for Ray "
        "(SLURM_CPUS_ON_NODE=2) where the plan reserves 4 per node (rollout.engines on the node "
        "× rollout.cpus_per_engine): Ray could never place the run's workers")
    assert short.options == "sbatch --nodes=1 --gres=gpu:8 --cpus-per-task=4"


@pytest.mark.parametrize("env,lacks", [
    # id: what SLURM set -> the part of the line that names the shortfall
    (_env(SLURM_JOB_NUM_NODES=1, SLURM_GPUS_ON_NODE=4, SLURM_CPUS_ON_NODE=32),
     "4 GPU(s) per node (SLURM_GPUS_ON_NODE=4) where the plan needs 8 per node"),
    (_env(SLURM_NNODES=1, SLURM_JOB_GPUS="0,1", SLURM_CPUS_ON_NODE=32),  # ids, counted
     "2 GPU(s) per node (SLURM_JOB_GPUS=2) where the plan needs 8 per node"),
    (_env(SLURM_JOB_NUM_NODES=1, SLURM_GPUS_ON_NODE=8, SLURM_CPUS_ON_NODE=32,
          MCORE_RL_RAY_CPUS=3),  # ray-run's override wins over SLURM's count
     "3 CPU(s) per node for Ray (MCORE_RL_RAY_CPUS=3)"),
], ids=["too-few-gpus", "job-gpus", "ray-cpus-override"])
def test_each_shortfall_names_its_variable(env, lacks):
    short = allocation_shortfall(node_bundles(COLOCATED, cpus_per_engine=1.0, gpu=True),
                                 SlurmAllocation.from_env(env))
    assert short is not None and lacks in short.lacks, short


def test_too_few_nodes_for_a_spread_plan():
    spread = plan_placement(actor_world=32, engine_tp=8, engines=4, devices_per_node=8,
                            placement="disaggregated")  # llama3-70b: 8 nodes
    bundles = node_bundles(spread, cpus_per_engine=1.0, gpu=True)
    short = allocation_shortfall(bundles, SlurmAllocation.from_env(
        _env(SLURM_JOB_NUM_NODES=2, SLURM_GPUS_ON_NODE=8, SLURM_CPUS_ON_NODE=32)))
    assert short.lacks.startswith("SLURM job 4242 has 2 node(s) (SLURM_JOB_NUM_NODES) where "
                                  "the plan spreads over 8")
    assert short.options == "sbatch --nodes=8 --gres=gpu:8 --cpus-per-task=32"


def test_an_allocation_that_fits_and_no_allocation_say_nothing():
    gpu = node_bundles(COLOCATED, cpus_per_engine=1.0, gpu=True)
    fits = SlurmAllocation.from_env(_env(SLURM_JOB_NUM_NODES=1, SLURM_GPUS_ON_NODE=8,
                                         SLURM_CPUS_ON_NODE=4))
    assert allocation_shortfall(gpu, fits) is None
    assert SlurmAllocation.from_env({"SLURM_CPUS_ON_NODE": "2"}) is None  # not in a job
    assert allocation_shortfall(gpu, None) is None
    # a CPU run needs no GPU: only its CPUs are checked
    cpu = node_bundles(COLOCATED, cpus_per_engine=1.0, gpu=False)
    assert allocation_shortfall(cpu, SlurmAllocation.from_env(
        _env(SLURM_JOB_NUM_NODES=1, SLURM_CPUS_ON_NODE=4))) is None
