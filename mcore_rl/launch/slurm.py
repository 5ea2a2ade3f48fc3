"""Running under SLURM (srun) or torchrun: which rank this process is, and where rank 0 is.

`launch_ranks` is a drop-in for `spawn.run_on_ranks`: with no launcher in the environment it
spawns local ranks exactly as `run_on_ranks` does; inside an `srun` step (or under torchrun) it
runs `fn` once, for this task's rank only, with the rendezvous taken from the environment, and
returns every rank's value in rank order (on every rank), as `run_on_ranks` does.

Rendezvous under srun: rank = SLURM_PROCID, world = SLURM_STEP_NUM_TASKS, local rank =
SLURM_LOCALID; MASTER_ADDR = the address of the step's first node (its SLURM NodeAddr) unless
set; MASTER_PORT = 20000 + job id % 20000 unless set (the formula `mcore-rl convert` uses).
Rank 0 hosts a `TCPStore` there (under torchrun every rank is a client of torchrun's agent
store on MASTER_PORT); the ranks' `fn` get it as `MCORE_RL_STORE_HOST`/`MCORE_RL_STORE_PORT`,
like the children of `run_on_ranks`. A batch script's own process (SLURM_PROCID=0 but no
SLURM_STEP_ID) is not a rank: there, `launch_ranks` spawns locally.

The same store carries the ranks' return values. A rank whose `fn` raises publishes its
traceback and raises at once (run srun with `--kill-on-bad-exit=1` so that peers stuck in a
collective are ended); a rank that finishes waits at most `timeout_s` for the others.
One `launch_ranks` call per process (the store lives on a fixed port for one call).
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch.distributed as dist

from mcore_rl.launch.listen import listening_store
from mcore_rl.launch.spawn import DistributedRunError, RankResult, run_on_ranks
from mcore_rl.parallel.world import join_default_group

_KEY = "mcore_rl_launch/"


class WorldSizeMismatch(DistributedRunError, ValueError):
    """The launcher started a different number of ranks than the run needs (a ValueError, so
    CLIs report it as bad input)."""


# --------------------------------------------------------------------------- node lists

def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1-2],b" -> ["a[1-2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(spec: str, where: str) -> list[str]:
    out = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"node list {where!r}: bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        if int(hi) < int(lo):
            raise ValueError(f"node list {where!r}: empty range {item!r}")
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list → names, in order (what `scontrol show hostnames` prints).

    "gpu[01-03,7],login" → gpu01 gpu02 gpu03 gpu7 login; "r[1-2]n[1-2]" → r1n1 r1n2 r2n1 r2n2.
    """
    names: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        match = re.search(r"\[([^\[\]]*)\]", part)
        if match is None:
            names.append(part)
            continue
        head, tail = part[:match.start()], part[match.end():]
        for value in _expand_range(match.group(1), nodelist):
            names.extend(expand_nodelist(head + value + tail))
    return names


def node_address(node: str) -> str:
    """The address SLURM reaches `node` at (its NodeAddr), else what the name resolves to."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        match = re.search(r"\bNodeAddr=(\S+)", out)
        if match:
            return socket.gethostbyname(match.group(1))
    except (OSError, subprocess.SubprocessError):
        pass
    return socket.gethostbyname(node)


def this_node_address(env: Mapping[str, str] = os.environ) -> str:
    """This node's address: MCORE_RL_NODE_IP if set, else its SLURM NodeAddr."""
    if env.get("MCORE_RL_NODE_IP"):
        return env["MCORE_RL_NODE_IP"]
    return node_address(env.get("SLURMD_NODENAME") or socket.gethostname())


# --------------------------------------------------------------------------- ranks

@dataclass(frozen=True)
class JobRanks:
    """This process's place in a launched job. launcher: "srun", "torchrun", or "env" (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by hand or by a previous `run_this_rank`)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str

    @property
    def hosts_store(self) -> bool:
        """Rank 0 hosts the rendezvous store, except under torchrun (its agent hosts it)."""
        return self.launcher != "torchrun" and self.rank == 0


def default_master_port(job_id: str | int) -> int:
    return 20000 + int(job_id) % 20000


def job_ranks_from_env(env: Mapping[str, str] = os.environ,
                       resolve: Callable[[str], str] = node_address) -> JobRanks | None:
    """This process's rank under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) or inside
    an srun step (SLURM_STEP_ID set); None when neither launched it."""
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ValueError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not")
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        return JobRanks(int(env["RANK"]), int(env["WORLD_SIZE"]),
                        int(env.get("LOCAL_RANK", "0")), env["MASTER_ADDR"],
                        int(env["MASTER_PORT"]), launcher)
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
    nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    addr = env.get("MASTER_ADDR") or resolve(expand_nodelist(nodes)[0])
    port = int(env.get("MASTER_PORT") or default_master_port(env["SLURM_JOB_ID"]))
    return JobRanks(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", "0")),
                    addr, port, "srun")


def is_primary(env: Mapping[str, str] = os.environ) -> bool:
    """True in a process that is not a launched rank, or is rank 0 of its job."""
    if "RANK" in env:
        return env["RANK"] == "0"
    if "SLURM_STEP_ID" in env:
        return env.get("SLURM_PROCID", "0") == "0"
    return True


def launch_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                 timeout_s: float = 180.0, init_default_group: bool = True,
                 env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """`spawn.run_on_ranks` when nothing launched this process; otherwise run `fn` for this
    task's rank only (see the module docstring). Same arguments, same return value."""
    job = job_ranks_from_env()
    if job is None:
        return run_on_ranks(fn, world_size, *args, timeout_s=timeout_s,
                            init_default_group=init_default_group, env=env, **kwargs)
    if job.world_size != world_size:
        raise WorldSizeMismatch(
            f"this run needs {world_size} ranks but the {job.launcher} step has "
            f"{job.world_size} tasks: launch it with srun --ntasks={world_size} "
            f"(or torchrun with {world_size} processes in all)")
    return run_this_rank(fn, job, *args, timeout_s=timeout_s,
                         init_default_group=init_default_group, env=env, **kwargs)


def run_this_rank(fn: Callable[..., Any], job: JobRanks, *args: Any, timeout_s: float = 180.0,
                  init_default_group: bool = True, env: dict[str, str] | None = None,
                  **kwargs: Any) -> list[Any]:
    """Run `fn(job.rank, job.world_size, *args, **kwargs)` here; exchange return values with
    the other ranks through the rendezvous store; every rank's value, in rank order."""
    timeout = datetime.timedelta(seconds=timeout_s + 60)
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK", "1"))
    os.environ.update({
        "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port),
        "RANK": str(job.rank), "WORLD_SIZE": str(job.world_size),
        "LOCAL_RANK": str(job.local_rank),
        "MCORE_RL_STORE_HOST": job.master_addr, "MCORE_RL_STORE_PORT": str(job.master_port),
        **(env or {})})
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"mcore-rl launch: {job.launcher} rank {job.rank}/{job.world_size} on {node}, "
          f"rendezvous {job.master_addr}:{job.master_port}",
          file=sys.stderr, flush=True)
    if job.hosts_store:
        store = listening_store(job.master_addr, job.master_port, job.world_size,
                                timeout_s=timeout.total_seconds())
    else:
        store = dist.TCPStore(job.master_addr, job.master_port, job.world_size,
                              is_master=False, timeout=timeout)
    results = dist.PrefixStore(_KEY + "result/", store)
    ok = False
    try:
        try:
            if init_default_group:
                join_default_group("gloo", store=dist.PrefixStore(_KEY + "pg/", store),
                                   rank=job.rank, world_size=job.world_size,
                                   timeout=datetime.timedelta(seconds=timeout_s))
            value = fn(job.rank, job.world_size, *args, **kwargs)
        except BaseException:  # noqa: BLE001 — published to the peers, then re-raised
            error = traceback.format_exc()
            results.set(str(job.rank), pickle.dumps(RankResult(job.rank, False, error=error)))
            raise DistributedRunError(f"rank {job.rank} failed:\n{error}") from None
        finally:
            if init_default_group and dist.is_initialized():
                dist.destroy_process_group()
        results.set(str(job.rank), pickle.dumps(RankResult(job.rank, True, value)))
        collected = _gather(results, job, timeout_s)
        ok = True
    finally:
        _release(store, job, wait=ok)
    failures = [r for r in collected if not r.ok]
    if failures:
        detail = "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in failures)
        raise DistributedRunError(f"ranks {[r.rank for r in failures]} failed:\n{detail}")
    return [r.value for r in collected]


def _gather(results: dist.Store, job: JobRanks, timeout_s: float) -> list[RankResult]:
    keys = [str(r) for r in range(job.world_size)]
    try:
        results.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 — name the ranks that did not report
        missing = [r for r in range(job.world_size) if not results.check([str(r)])]
        raise DistributedRunError(f"rank {job.rank}: ranks {missing} did not finish within "
                                  f"{timeout_s:.0f} s") from None
    return [pickle.loads(results.get(k)) for k in keys]


def _release(store: dist.TCPStore, job: JobRanks, wait: bool) -> None:
    """Rank 0 keeps its store up until every rank has read the results (bounded wait; none
    after a failure: the peers learn of it from their own errors)."""
    done = dist.PrefixStore(_KEY + "done/", store)
    try:
        done.set(str(job.rank), b"1")
        if job.hosts_store and wait:
            done.wait([str(r) for r in range(job.world_size)], datetime.timedelta(seconds=30))
    except Exception:  # noqa: BLE001 — a peer that died is reported by the peers' errors
        pass


__all__ = ["JobRanks", "WorldSizeMismatch", "default_master_port", "expand_nodelist",
           "is_primary", "job_ranks_from_env", "launch_ranks", "node_address", "run_this_rank",
           "this_node_address"]
