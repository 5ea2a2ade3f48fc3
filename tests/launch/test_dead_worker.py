"""launch.watchdog.collect_or_name_dead names a worker that died even when a peer's error
arrives first (a survivor's collective fails as soon as its peer's process is gone, often before
Ray reports the death), and passes a worker's own error on when nobody died."""

from __future__ import annotations

import os
import time

import pytest


def _workers(n: int):
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def pid(self) -> int:
            return os.getpid()

        def fail(self, after_s: float) -> None:
            time.sleep(after_s)
            raise RuntimeError("Connection closed by peer")

        def die(self, after_s: float) -> None:
            time.sleep(after_s)
            os._exit(1)

        def answer(self, after_s: float) -> int:
            time.sleep(after_s)
            return 7

    return [Worker.remote() for _ in range(n)]


def test_a_dead_worker_is_named_though_its_peers_error_came_first(ray_cluster):
    import ray

    from mcore_rl.launch.watchdog import WorkerDied, collect_or_name_dead

    workers = _workers(2)
    try:
        pids = ray.get([w.pid.remote() for w in workers])
        refs = [workers[0].fail.remote(0.0), workers[1].die.remote(0.5)]
        with pytest.raises(WorkerDied, match=rf"actor rank 1 \(pid {pids[1]}\) died during "
                                             r"phase 'old_logprob'"):
            collect_or_name_dead(refs, 60.0, "old_logprob", pids)
    finally:
        for worker in workers:
            ray.kill(worker)


def test_a_workers_own_error_is_passed_on_when_nobody_died(ray_cluster):
    import ray
    from ray.exceptions import RayTaskError

    from mcore_rl.launch.watchdog import collect_or_name_dead

    workers = _workers(2)
    try:
        refs = [workers[0].fail.remote(0.0), workers[1].answer.remote(0.5)]
        with pytest.raises(RayTaskError, match="Connection closed by peer"):
            collect_or_name_dead(refs, 60.0, "old_logprob")
    finally:
        for worker in workers:
            ray.kill(worker)
