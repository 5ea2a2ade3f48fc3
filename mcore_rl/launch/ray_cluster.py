"""A Ray cluster over a SLURM allocation, for one driver (an RL run) — used by
scripts/slurm/train.sbatch through `python -m mcore_rl.cli ray-run -- ...`.

Layout: the batch script's node (the allocation's first node) runs the Ray head and the
driver; every other node runs one `ray start --block` worker, all from one
`srun --overlap --ntasks-per-node=1` step. Every Ray node registers under its SLURM NodeAddr
(override: MCORE_RL_NODE_IP) — on a one-node loopback cluster it also listens on loopback only;
with several nodes Ray 2.60 listens on all interfaces whatever the address (checked on the test
cluster). The dashboard and usage stats are off, the head's GCS port is
`MCORE_RL_RAY_PORT` or derived from the job id (several jobs can share a node), and the Ray
temp dir is per job (/tmp/ray-<job id>).

Nothing here calls `ray stop` (it kills every Ray on the machine, other users' included): the
head and the workers are `--block` processes this launcher started, so ending them ends their
Ray processes; they also die with the launcher (PR_SET_PDEATHSIG) if it is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from mcore_rl.launch.exit_codes import STOP_EXIT_CODE, WORKER_FAILED_EXIT_CODE
from mcore_rl.launch.slurm import expand_nodelist, node_address, this_node_address

WORKER_STEP_NAME = "mcore-rl-ray-workers"


class RayClusterError(RuntimeError):
    """The Ray cluster did not come up (which node, what happened, where the logs are)."""


def ray_env(node_ip: str, base: Mapping[str, str] = os.environ, *,
            multi_node: bool) -> dict[str, str]:
    """Environment for the Ray processes of a node at `node_ip` (and for the driver).

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: "0" makes Ray fall back to loopback wherever it looks
    an address up itself, but also makes `ray start --address` refuse to
    join a cluster. Every address here is explicit, so: "0" for a one-node cluster, "1" for
    several nodes."""
    env = dict(base)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1" if multi_node else "0"
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")  # SIGTERM: stop at once
    env["VLLM_HOST_IP"] = node_ip
    env["MCORE_RL_NODE_IP"] = node_ip
    return env


def connect_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """Connect this process, as a driver, to the running cluster named by RAY_ADDRESS
    ("host:port"); a no-op if Ray is initialized already. Returns False (and does nothing)
    when RAY_ADDRESS is unset — for `init_local_ray` to start a local Ray instead.

    The driver registers under MCORE_RL_NODE_IP if set, else (inside a SLURM job) its node's
    NodeAddr — the address its node's raylet was started with — else Ray's own guess."""
    address = env.get("RAY_ADDRESS")
    if not address:
        return False
    import ray  # lazy: ray

    if ray.is_initialized():
        return True
    node_ip = env.get("MCORE_RL_NODE_IP") or (this_node_address(env)
                                               if env.get("SLURMD_NODENAME") else None)
    ray.init(address=address, _node_ip_address=node_ip)
    return True


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the launcher dies (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def ray_executable() -> str:
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


@dataclass(frozen=True, kw_only=True)
class RayClusterConfig:
    """port: the head's GCS port. join_timeout_s: deadline for the head to answer and every
    node to join. cpus_per_node: Ray CPUs per node (default: SLURM_CPUS_ON_NODE).
    temp_dir: Ray's session dir root. stop_timeout_s: grace before SIGKILL on shutdown."""

    port: int
    join_timeout_s: float = 180.0
    cpus_per_node: int | None = None
    temp_dir: str = "/tmp/ray"
    stop_timeout_s: float = 30.0

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port}: must be in 1..65535")
        if self.join_timeout_s <= 0:
            raise ValueError(f"join_timeout_s={self.join_timeout_s}: must be > 0")
        if self.cpus_per_node is not None and self.cpus_per_node < 0:
            raise ValueError(f"cpus_per_node={self.cpus_per_node}: must be >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **overrides) -> RayClusterConfig:
        job = int(env.get("SLURM_JOB_ID", "0"))
        values = dict(port=int(env.get("MCORE_RL_RAY_PORT") or 30000 + job % 10000),
                      join_timeout_s=float(env.get("MCORE_RL_RAY_JOIN_TIMEOUT", "180")),
                      temp_dir=env.get("MCORE_RL_RAY_TMPDIR") or f"/tmp/ray-{job}")
        cpus = env.get("MCORE_RL_RAY_CPUS") or env.get("SLURM_CPUS_ON_NODE")
        if cpus:
            values["cpus_per_node"] = int(cpus)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def head_command(cfg: RayClusterConfig, node_ip: str) -> list[str]:
    cmd = [ray_executable(), "start", "--head", "--block", f"--node-ip-address={node_ip}",
           f"--port={cfg.port}", "--include-dashboard=false", "--disable-usage-stats",
           f"--temp-dir={cfg.temp_dir}"]
    if cfg.cpus_per_node is not None:
        cmd.append(f"--num-cpus={cfg.cpus_per_node}")
    return cmd


def node_command(cfg: RayClusterConfig, address: str, node_ip: str) -> list[str]:
    cmd = [ray_executable(), "start", "--block", f"--address={address}",
           f"--node-ip-address={node_ip}", "--disable-usage-stats"]
    if cfg.cpus_per_node is not None:
        cmd.append(f"--num-cpus={cfg.cpus_per_node}")
    return cmd


def run_node(cfg: RayClusterConfig, address: str) -> None:
    """On a worker node (one srun task per node): become `ray start --block` (exec)."""
    node_ip = this_node_address()
    cmd = node_command(cfg, address, node_ip)
    print(f"ray node {os.environ.get('SLURMD_NODENAME', socket.gethostname())} ({node_ip}) "
          f"joining {address}", flush=True)
    os.execvpe(cmd[0], cmd, ray_env(node_ip, multi_node=True))


@dataclass
class SlurmRayCluster:
    """Head here, one worker per other node of the allocation. Use as a context manager:
    on entry the cluster is up with every node joined and this process is its driver
    (`ray.init` done, RAY_ADDRESS set); on exit everything this started is stopped."""

    cfg: RayClusterConfig
    nodes: list[str] = field(default_factory=list)
    head_ip: str = ""
    _head: subprocess.Popen | None = None
    _workers: subprocess.Popen | None = None

    @classmethod
    def from_env(cls, cfg: RayClusterConfig,
                 env: Mapping[str, str] = os.environ) -> SlurmRayCluster:
        if "SLURM_JOB_NODELIST" not in env:
            raise RayClusterError("not inside a SLURM allocation (SLURM_JOB_NODELIST unset): "
                                  "run this from an sbatch script or salloc")
        nodes = expand_nodelist(env["SLURM_JOB_NODELIST"])
        here = env.get("SLURMD_NODENAME")
        if here and here != nodes[0]:
            raise RayClusterError(f"the head must run on the allocation's first node "
                                  f"{nodes[0]}, this is {here}")
        head_ip = env.get("MCORE_RL_NODE_IP") or node_address(nodes[0])
        return cls(cfg=cfg, nodes=nodes, head_ip=head_ip)

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.cfg.port}"

    def __enter__(self) -> SlurmRayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        env = ray_env(self.head_ip, multi_node=len(self.nodes) > 1)
        os.environ.update({k: env[k] for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                                               "RAY_USAGE_STATS_ENABLED", "VLLM_HOST_IP",
                                               "MCORE_RL_NODE_IP")})
        started = time.monotonic()
        deadline = started + self.cfg.join_timeout_s
        print(f"ray head on {self.nodes[0]} ({self.address}), {len(self.nodes)} node(s): "
              f"{','.join(self.nodes)}", flush=True)
        self._head = subprocess.Popen(head_command(self.cfg, self.head_ip), env=env,
                                      preexec_fn=_die_with_parent)
        self._wait_for_port(deadline)
        if len(self.nodes) > 1:
            self._workers = subprocess.Popen(self._worker_step(), preexec_fn=_die_with_parent)
        import ray  # lazy: ray

        os.environ["RAY_ADDRESS"] = self.address
        ray.init(address=self.address, _node_ip_address=self.head_ip)
        self._wait_for_nodes(deadline)
        print(f"ray cluster up: {len(self.nodes)} node(s) in "
              f"{time.monotonic() - started:.1f} s", flush=True)

    def _worker_step(self) -> list[str]:
        others = self.nodes[1:]
        return ["srun", "--overlap", f"--job-name={WORKER_STEP_NAME}",
                f"--nodes={len(others)}", f"--ntasks={len(others)}", "--ntasks-per-node=1",
                f"--nodelist={','.join(others)}",
                "--kill-on-bad-exit=0", sys.executable, "-m", "mcore_rl.launch.ray_cluster",
                "ray-node", f"--address={self.address}", f"--port={self.cfg.port}",
                *([f"--cpus-per-node={self.cfg.cpus_per_node}"]
                  if self.cfg.cpus_per_node is not None else [])]

    def _wait_for_port(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self._head.poll() is not None:
                raise RayClusterError(f"ray head on {self.nodes[0]} exited with code "
                                      f"{self._head.returncode} before listening on "
                                      f"{self.address} (logs: {self.cfg.temp_dir})")
            with socket.socket() as s:
                s.settimeout(1.0)
                if s.connect_ex((self.head_ip, self.cfg.port)) == 0:
                    return
            time.sleep(0.2)
        raise RayClusterError(f"ray head on {self.nodes[0]} did not listen on {self.address} "
                              f"within {self.cfg.join_timeout_s:.0f} s")

    def _wait_for_nodes(self, deadline: float) -> None:
        import ray  # lazy: ray

        want = len(self.nodes)
        alive: list[dict] = []
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if len(alive) >= want:
                return
            if self._workers is not None and self._workers.poll() is not None:
                raise RayClusterError(f"the Ray worker step (srun on {','.join(self.nodes[1:])}) "
                                      f"exited with code {self._workers.returncode}; "
                                      f"{len(alive)} of {want} nodes had joined")
            if time.monotonic() > deadline:
                raise RayClusterError(
                    f"only {len(alive)} of {want} Ray nodes joined {self.address} within "
                    f"{self.cfg.join_timeout_s:.0f} s (joined: "
                    f"{sorted(n.get('NodeManagerAddress', '?') for n in alive)}; expected "
                    f"{','.join(self.nodes)}); see the job output for the worker nodes' errors")
            time.sleep(0.5)

    def stop(self) -> None:
        try:
            import ray  # lazy: ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception as err:  # noqa: BLE001 — keep stopping the processes
            print(f"ray.shutdown failed: {err}", file=sys.stderr)
        started, t0 = self._head is not None, time.monotonic()
        # Workers first (they report to the head's GCS): SIGTERM their tasks, not srun (which
        # would SIGKILL them), and wait; srun itself is signalled only if that did not work.
        if self._workers is not None and self._workers.poll() is None:
            signalled = _signal_step(WORKER_STEP_NAME)
            _terminate(self._workers, self.cfg.stop_timeout_s, already_signalled=signalled)
        _terminate(self._head, self.cfg.stop_timeout_s)
        self._workers = self._head = None
        if started:
            print(f"ray cluster stopped in {time.monotonic() - t0:.1f} s", flush=True)


def _signal_step(name: str) -> bool:
    """SIGTERM the tasks of this job's step `name` (`ray start --block` then stops its Ray
    processes). SIGTERM to srun itself would SIGKILL the tasks at once."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        steps = subprocess.run(["squeue", "--steps", f"--jobs={job}", "-h", "-o", "%i|%j"],
                               capture_output=True, text=True, timeout=30).stdout
        ids = [step for step, _, step_name in (line.partition("|") for line in
                                                steps.splitlines()) if step_name == name]
        for step in ids:
            subprocess.run(["scancel", "--signal=TERM", step], capture_output=True, timeout=30)
        return bool(ids)
    except (OSError, subprocess.SubprocessError):
        return False


def _terminate(proc: subprocess.Popen | None, timeout_s: float, *,
               already_signalled: bool = False) -> None:
    """SIGTERM `proc` (unless its tasks were signalled already), wait up to `timeout_s`, then
    SIGKILL it."""
    if proc is None or proc.poll() is not None:
        return
    if already_signalled:
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class Terminated(Exception):
    """SIGTERM (scancel) or SIGUSR1 (the time limit's `--signal=B:USR1@N`, forwarded by
    train.sbatch) reached the launcher outside the training's own handlers (which stop at a
    safe point with a checkpoint: run/signals.py)."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_terminated(signum, frame):
    signal.signal(signum, signal.SIG_IGN)  # a second signal must not cut the clean-up
    raise Terminated(signum)


def _stop_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _raise_terminated)


def run_with_cluster(cfg: RayClusterConfig, argv: Sequence[str],
                     run_command: Callable[[list[str]], int]) -> int:
    """Bring the cluster up, run `run_command(ARGV)` (the mcore-rl CLI: `mcore-rl ray-run`
    passes its own entry point) in this process as its driver (its
    `init_local_ray` finds Ray initialized and keeps it), stop the cluster. Returns the
    command's exit code (128 + 15 on SIGTERM outside the training, 75 on SIGUSR1 before it
    started, 3 if the cluster did not come up); an exception
    from the command propagates after the cluster is stopped."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    _stop_handlers()
    try:
        with SlurmRayCluster.from_env(cfg):
            # ray.init installed its own (aborting) SIGTERM handler in this process: ours again
            _stop_handlers()
            print(f"running: mcore-rl {' '.join(argv)}", flush=True)
            try:
                return int(run_command(list(argv)) or 0)
            except SystemExit as exit_:  # argparse errors, sys.exit in a command
                code = exit_.code
                return code if isinstance(code, int) else (0 if code is None else 1)
    except RayClusterError as err:
        print(f"mcore-rl ray-run: {err}", file=sys.stderr, flush=True)
        return WORKER_FAILED_EXIT_CODE
    except Terminated as stop:
        name = signal.Signals(stop.signum).name
        if stop.signum == signal.SIGUSR1:  # before training started: nothing to save, requeue
            print(f"mcore-rl ray-run: {name} before the run started; Ray stopped (exit "
                  f"{STOP_EXIT_CODE}: requeue)", file=sys.stderr, flush=True)
            return STOP_EXIT_CODE
        print(f"mcore-rl ray-run: terminated ({name}); Ray stopped", file=sys.stderr,
              flush=True)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


__all__ = ["RayClusterConfig", "RayClusterError", "SlurmRayCluster", "connect_from_env",
           "head_command", "node_command", "ray_env", "run_node", "run_with_cluster"]


# --------------------------------------------------------------------------- entry point

def _add_cluster_parser(sub, name: str) -> argparse.ArgumentParser:
    """`ray-run` (the batch script's node: Ray head + driver) or `ray-node` (run by srun on
    every other node). Options default from the environment (MCORE_RL_RAY_PORT,
    MCORE_RL_RAY_JOIN_TIMEOUT, MCORE_RL_RAY_CPUS or SLURM_CPUS_ON_NODE, MCORE_RL_RAY_TMPDIR)."""
    helps = {"ray-run": "start Ray over a SLURM allocation, run the mcore-rl command after -- "
                        "as its driver, stop Ray; exits with the command's code "
                        "(scripts/slurm/train.sbatch)",
             "ray-node": "join the Ray head (one srun task per worker node)"}
    p = sub.add_parser(name, help=helps[name])
    p.add_argument("--port", type=int, default=None,
                   help="the head's GCS port (default: Ray's)")
    p.add_argument("--cpus-per-node", type=int, default=None,
                   help="CPUs each node offers Ray (default: SLURM_CPUS_ON_NODE)")
    if name == "ray-run":
        p.add_argument("--join-timeout", type=float, default=None,
                       help="seconds for every node to join (default 180)")
        p.add_argument("args", nargs=argparse.REMAINDER,
                       help="-- then the mcore-rl command to run as the driver, e.g. -- train "
                            "configs/gpu/llama3-70b.yaml")
    else:
        p.add_argument("--address", required=True, help="head HOST:PORT")
    return p


def _run_cluster_command(parser: argparse.ArgumentParser, args: argparse.Namespace,
                         run_command: Callable[[list[str]], int] | None) -> int:
    try:
        cfg = RayClusterConfig.from_env(port=args.port, cpus_per_node=args.cpus_per_node,
                                        join_timeout_s=getattr(args, "join_timeout", None))
    except ValueError as err:
        parser.error(str(err))
    if args.command == "ray-node":
        run_node(cfg, args.address)  # does not return
        return 1
    command = args.args[1:] if args.args[:1] == ["--"] else args.args
    if not command:
        parser.error("ray-run: give the mcore-rl command after --, e.g. -- train --config X")
    return run_with_cluster(cfg, command, run_command)


def add_parser(sub) -> None:
    """`mcore-rl ray-run [options] -- COMMAND ...`: the CLI hands its own entry point in
    (`cli_main`), so the command runs in this process as the cluster's driver."""
    p = _add_cluster_parser(sub, "ray-run")
    p.set_defaults(func=lambda args: _run_cluster_command(p, args, args.cli_main))


def main(argv: list[str] | None = None) -> int:
    """`python -m mcore_rl.launch.ray_cluster ray-node --address HOST:PORT` (run by srun on every
    node but the batch script's, which runs `mcore-rl ray-run`)."""
    parser = argparse.ArgumentParser(prog="python -m mcore_rl.launch.ray_cluster",
                                     description="a worker node of Ray over a SLURM "
                                                 "allocation (scripts/slurm/train.sbatch)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_cluster_parser(sub, "ray-node")
    args = parser.parse_args(argv)
    return _run_cluster_command(parser, args, None)


if __name__ == "__main__":
    sys.exit(main())
