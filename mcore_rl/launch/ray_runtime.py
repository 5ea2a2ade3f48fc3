"""The driver's Ray: a one-machine instance bound to loopback, or the cluster RAY_ADDRESS names.

A shell's or batch system's signal to the process group — a terminal's Ctrl-C (SIGINT) too —
also reaches the local Ray's gcs_server, raylet and helper processes, which ray.init starts in
the driver's group (its actor workers, the actor ranks and the vLLM engines, get their own
groups): the GCS would die at once and the run could not even write its checkpoint
(mcore_rl/run/signals.py stops a run cleanly on SIGTERM, SIGUSR1 and SIGINT). `start_local_ray`
therefore starts them with SIGTERM and SIGINT blocked (inherited through fork/exec; Ray's own
process launcher blocks SIGINT as well): they live until the run shuts them down.
`stop_local_ray` then stops them with SIGKILL at once: ray.shutdown's SIGTERM cannot reach
them, and Ray would wait a second on each before it sends SIGKILL itself. Under SLURM, Ray runs
as `ray start --block` and the batch script forwards signals only to the driver (train.sbatch).

Whoever brings Ray up stops it: `init_local_ray` and `start_local_ray` return True when the call
initialized Ray, and only such a caller calls `stop_local_ray` (the controller, the CLI run). A
Ray that was up already — a test session's, kept for all its tests (tests/support/ray_cluster.py)
— is left running; its user stops its own workers and placement group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import psutil

from mcore_rl.launch.logs import reapply_process_logs, verbose


def init_local_ray(num_cpus: int | None = None, host_ip: str = "127.0.0.1") -> bool:
    """Start a one-machine Ray instance bound to `host_ip` unless Ray is already initialized.
    Returns True when this call initialized Ray (a local instance, or the cluster RAY_ADDRESS
    names): the caller then owns it and stops it (`stop_local_ray`); False when it was up.

    Loopback really binds loopback only if `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is in the
    environment before `ray` is first imported (vLLM imports it): on Linux, Ray 2.60 otherwise
    turns `_node_ip_address="127.0.0.1"` into the machine's routable address and its GCS,
    raylet and workers listen on all interfaces. This sets it (when not set) and checks the
    result: a Ray that ended up on another address is shut down and reported. Token auth is
    turned off (Ray 2.60 enables it when ~/.ray/auth_token exists) unless RAY_AUTH_MODE is set.
    """
    loopback = host_ip.startswith("127.") or host_ip in ("localhost", "::1")
    if loopback:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("VLLM_HOST_IP", host_ip)
    import ray  # lazy: ray

    if ray.is_initialized():
        return False
    from mcore_rl.launch.ray_cluster import connect_from_env  # lazy: torch

    if connect_from_env():  # a cluster named by RAY_ADDRESS (e.g. started by the sbatch script)
        return True
    # library INFO lines of every worker stay in their RUN_DIR/logs files unless --verbose;
    # `import ray` gave the driver's "ray" logger its console handler back
    reapply_process_logs()
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
             _node_ip_address=host_ip, log_to_driver=verbose())
    actual = ray.util.get_node_ip_address()
    if loopback and actual != host_ip:
        ray.shutdown()
        raise RuntimeError(
            f"Ray came up on {actual}, not {host_ip}: set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "
            "in the environment before anything imports ray (vLLM does), or init Ray yourself")
    return True


@contextlib.contextmanager
def signals_blocked_in_children(signals=(signal.SIGTERM, signal.SIGINT)):
    """Processes started inside inherit `signals` blocked (the mask survives fork and exec);
    a signal arriving here meanwhile is delivered to this process when the block ends.
    SIGUSR1 stays open: the watchdog's stack dumps use it in the workers."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# start_local_ray brought Ray up here (as a cluster's driver too: its node then lists no
# processes of ours, so stop_local_ray has nothing to kill)
_started_deaf_to_sigterm = False


def start_local_ray() -> bool:
    """The driver's Ray (a local instance, or the cluster named by RAY_ADDRESS), its local
    processes shielded from the group's SIGTERM and SIGINT (see the module doc). Returns True
    when this call initialized Ray (the caller stops it), False when it was up already."""
    global _started_deaf_to_sigterm
    # not `import ray` here: init_local_ray sets Ray's environment before the first import
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return False
    with signals_blocked_in_children():
        init_local_ray(num_cpus=max(2, os.cpu_count() or 2))
    _started_deaf_to_sigterm = True
    return True


def stop_local_ray() -> None:
    """`ray.shutdown()`; the processes `start_local_ray` started (SIGTERM blocked) are sent
    SIGKILL instead of the SIGTERM they cannot receive, which Ray would follow with SIGKILL a
    second later each. Workers and engines should be stopped first (the controller does).
    Only for the caller whose `init_local_ray` / `start_local_ray` returned True."""
    global _started_deaf_to_sigterm
    import ray  # lazy: ray

    node = ray._private.worker._global_node  # processes this driver started (none: a cluster)
    below = []  # the raylet's agents and workers: they fate-share with it by reporting its
    # death to the GCS, which is gone by then, so they would outlive it; stopped here instead
    if _started_deaf_to_sigterm and node is not None:
        for infos in node.all_processes.values():
            for info in infos:
                info.process.terminate = info.process.kill  # Ray calls terminate, then waits
                with contextlib.suppress(psutil.Error):
                    below += psutil.Process(info.process.pid).children(recursive=True)
    _started_deaf_to_sigterm = False
    ray.shutdown()
    for process in below:
        with contextlib.suppress(psutil.Error):
            process.kill()


def kill_local_ray() -> None:
    """SIGKILL, at once, every process `start_local_ray` started and everything under them
    (the raylet's agents, the actor ranks, the engines and their vLLM processes), without
    `ray.shutdown()`: for a driver about to exit without cleaning up (a second Ctrl-C, a
    stop past its grace), which would otherwise leave the raylet's agents running. A no-op
    when this process did not start a local Ray."""
    if not _started_deaf_to_sigterm or "ray" not in sys.modules:
        return

    node = sys.modules["ray"]._private.worker._global_node
    if node is None:
        return
    doomed = []
    for infos in node.all_processes.values():
        for info in infos:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(info.process.pid)
                doomed += [process, *process.children(recursive=True)]
    for process in doomed:
        with contextlib.suppress(psutil.Error):
            process.kill()
