"""CPU seconds of this process and of every process it started, by role.

Where every core is busy, wall time cannot fall below the CPU work divided by the cores, and
overlapping phases gains nothing: `cpu_by_role` and `cpu_floor_s` make that visible (the demo
writes both for its start-up into summary.json). With a Ray instance this process started,
Ray's GCS and raylet, its workers, the actor ranks, the engines and their vLLM worker
processes are all descendants; with a cluster started elsewhere only the driver is counted.
"""

from __future__ import annotations

import os

import psutil

# a process's role from its title (Ray names an actor's process "ray::<Class>[.<method>]");
# processes below one (vLLM's TP workers under an engine) inherit it
ROLES = (("actor ranks", "ray::ActorWorker"), ("engines", "ray::EngineHost"),
         ("reward model", "ray::RewardWorker"))
OTHER = "ray"  # GCS, raylet, idle and helper workers


def role_of(title: str) -> str | None:
    """The role a process title names, or None (then the parent's role applies)."""
    for role, prefix in ROLES:
        if title.startswith(prefix):
            return role
    return None


def cpu_by_role() -> dict[str, float]:
    """User + system CPU seconds: "driver" (this process) and each role's processes below it,
    and "total". Processes that exit while being read are skipped."""
    me = psutil.Process()
    spent = {"driver": _cpu(me)}

    def walk(proc, inherited: str) -> None:
        for child in proc.children():
            try:
                title = " ".join(child.cmdline()[:1])
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            role = role_of(title) or inherited
            spent[role] = spent.get(role, 0.0) + _cpu(child)
            walk(child, role)

    walk(me, OTHER)
    spent["total"] = sum(spent.values())
    return {role: round(seconds, 2) for role, seconds in spent.items()}


def cpu_floor_s(total_cpu_s: float, cores: int | None = None) -> float:
    """The shortest wall time that much CPU work can take on `cores` (default: the cores this
    process may run on)."""
    cores = cores or len(os.sched_getaffinity(0))
    return round(total_cpu_s / cores, 2)


def _cpu(proc) -> float:
    try:
        times = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0.0
    return times.user + times.system


__all__ = ["cpu_by_role", "cpu_floor_s", "role_of"]
