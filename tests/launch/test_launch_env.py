"""The launcher side without a cluster: SLURM node lists, which rank a process is under
srun / torchrun / an sbatch script, `launch_ranks` as one rank per task (two processes given a
faked srun environment), and the Ray-on-SLURM commands."""

import json
import os
import random
import socket
import subprocess
import sys
import textwrap

import pytest

from mcore_rl.launch.ray_cluster import (RayClusterConfig, SlurmRayCluster, connect_from_env,
                                         head_command, node_command, ray_env)
from mcore_rl.launch.slurm import (JobRanks, WorldSizeMismatch, expand_nodelist, is_primary,
                                   job_ranks_from_env, launch_ranks)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("nodelist, names", [
    ("localhost", ["localhost"]),                                  # one plain name
    ("n[1-3]", ["n1", "n2", "n3"]),                                # a range
    ("gpu[08-10,12],login", ["gpu08", "gpu09", "gpu10", "gpu12", "login"]),  # zero padding
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),            # two bracket groups
    ("a[1],b-x[3-4]", ["a1", "b-x3", "b-x4"]),                     # dash in the prefix
])
def test_expand_nodelist(nodelist, names):
    assert expand_nodelist(nodelist) == names


@pytest.mark.parametrize("bad", ["n[1-", "n1]", "n[a-b]", "n[3-1]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(bad)


SRUN = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "n[7-8]", "SLURM_JOB_NODELIST": "n[7-9]"}


def test_srun_task_is_one_rank_with_rendezvous_on_the_first_step_node():
    resolved = []
    job = job_ranks_from_env(SRUN, resolve=lambda name: resolved.append(name) or "10.0.0.7")
    assert job == JobRanks(rank=1, world_size=4, local_rank=1, master_addr="10.0.0.7",
                           master_port=20000 + 1234, launcher="srun")
    assert resolved == ["n7"] and not job.hosts_store
    env = {**SRUN, "MASTER_ADDR": "h", "MASTER_PORT": "555", "SLURM_PROCID": "0"}
    job = job_ranks_from_env(env, resolve=pytest.fail)
    assert (job.master_addr, job.master_port, job.hosts_store) == ("h", 555, True)


def test_batch_script_and_plain_processes_are_not_ranks():
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}  # no step id
    assert job_ranks_from_env(batch, resolve=pytest.fail) is None
    assert job_ranks_from_env({}, resolve=pytest.fail) is None
    assert is_primary({}) and is_primary(batch)
    assert not is_primary(SRUN) and is_primary({**SRUN, "SLURM_PROCID": "0"})


def test_torchrun_ranks_use_torchruns_store():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    job = job_ranks_from_env(env, resolve=pytest.fail)
    assert job.launcher == "torchrun" and not job.hosts_store
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        job_ranks_from_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_world_size_mismatch_is_reported_before_any_rendezvous(monkeypatch):
    for key, value in {**SRUN, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(WorldSizeMismatch, match="needs 2 ranks but the srun step has 4 tasks"):
        launch_ranks(pytest.fail, 2)


_CHILD = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from mcore_rl.launch.slurm import launch_ranks

    def fn(rank, world, mode):
        if mode == "fail":
            if rank == 1:
                raise RuntimeError("boom on rank 1")
            return rank
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)  # the default group launch_ranks built from the environment
        store = os.environ["MCORE_RL_STORE_HOST"] + ":" + os.environ["MCORE_RL_STORE_PORT"]
        return {"rank": rank, "sum": t.item(), "pid": os.getpid(), "store": store}

    try:
        print(json.dumps(launch_ranks(fn, 2, sys.argv[1], timeout_s=60)))
    except Exception as err:
        print("ERROR", type(err).__name__, str(err).splitlines()[0])
        sys.exit(1)
""")


def _port_below_the_ephemeral_range() -> int:
    """A free port under Linux's ephemeral range (32768+): a port bound to 0 comes from that
    range, where any process's outgoing connection may take it between this probe and rank 0's
    bind; below it, only a process that binds that number can."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-31999")


# launch_ranks' rendezvous waits timeout_s + 60 = 120 s: a rank stuck there ends in its own
# diagnosis before this deadline ends the test
_RANK_DEADLINE_S = 240


def _fake_srun(mode: str, tries: int = 3) -> list[tuple[int, str]]:
    """Two processes as one srun step would start them. Rank 0's store binds the port given;
    if another process took it first, both ranks are stopped and the step starts again."""
    for _ in range(tries):
        procs = _start_fake_ranks(mode, _port_below_the_ephemeral_range())
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=_RANK_DEADLINE_S)
            out.append((p.returncode, stdout.strip().splitlines()[-1] if stdout.strip() else stderr))
            if p is procs[0] and "Address already in use" in out[0][1]:
                procs[1].kill()
                procs[1].communicate()
                break
        else:
            return out
    raise AssertionError(f"rank 0 found its port taken {tries} times")


def _start_fake_ranks(mode: str, port: int) -> list[subprocess.Popen]:
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(SRUN, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                   SLURM_STEP_NUM_TASKS="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, "-c", _CHILD, mode], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def test_launch_ranks_runs_one_rank_per_task_and_returns_every_value():
    (rc0, out0), (rc1, out1) = _fake_srun("ok")
    assert rc0 == rc1 == 0, (out0, out1)
    values = json.loads(out0)
    assert json.loads(out1) == values  # every rank gets every rank's value, in rank order
    assert [v["rank"] for v in values] == [0, 1] and {v["sum"] for v in values} == {3.0}
    assert values[0]["pid"] != values[1]["pid"]  # one process per rank, no local spawning
    assert values[0]["store"].startswith("127.0.0.1:")


def test_a_failing_rank_fails_every_rank_and_is_named():
    (rc0, out0), (rc1, out1) = _fake_srun("fail")
    assert rc0 == rc1 == 1
    assert out1.startswith("ERROR DistributedRunError rank 1 failed"), out1
    assert out0.startswith("ERROR DistributedRunError ranks [1] failed"), out0


def test_ray_cluster_layout_from_the_allocation(monkeypatch):
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n1",
           "SLURM_CPUS_ON_NODE": "8", "MCORE_RL_NODE_IP": "10.0.0.1"}
    cfg = RayClusterConfig.from_env(env)
    assert (cfg.port, cfg.cpus_per_node, cfg.temp_dir) == (30042, 8, "/tmp/ray-42")
    cluster = SlurmRayCluster.from_env(cfg, env)
    assert cluster.address == "10.0.0.1:30042"
    head = head_command(cfg, "10.0.0.1")
    assert {"--head", "--block", "--include-dashboard=false", "--node-ip-address=10.0.0.1",
            "--port=30042", "--num-cpus=8", "--temp-dir=/tmp/ray-42"} <= set(head)
    step = cluster._worker_step()
    assert step[0] == "srun" and {"--overlap", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                                  "--nodelist=n2,n3"} <= set(step)
    assert "--address=10.0.0.1:30042" in step
    assert "--block" in node_command(cfg, cluster.address, "10.0.0.2")
    with pytest.raises(RuntimeError, match="first node n1, this is n2"):
        SlurmRayCluster.from_env(cfg, {**env, "SLURMD_NODENAME": "n2"})
    with pytest.raises(ValueError, match="port=0"):
        RayClusterConfig(port=0)
    # one node: Ray keeps to the given (loopback) address; several: workers must be let join
    assert ray_env("127.0.0.1", {}, multi_node=False)["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert ray_env("10.0.0.2", {}, multi_node=True)["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert connect_from_env({}) is False  # no RAY_ADDRESS: init_local_ray starts a local Ray
