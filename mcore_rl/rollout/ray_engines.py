"""Data-parallel rollout: `RolloutConfig.engines` vLLM engines, each in its own Ray actor.

Each actor hosts one `RolloutEngine` in-process (its TP workers, when tp > 1, are that
engine's own mp-executor processes). Prompts are cut into contiguous chunks, one per engine,
and results come back in prompt order; seeds depend on a prompt's global index, so results do
not depend on the number of engines. Engine i's TP rank r is sync rank
`first_sync_rank + i * tp + r` (engine-major, as `layouts.vllm_shards` numbers them).

Every call has a deadline (`start_timeout_s` for start-up, `call_timeout_s` or the call's
`timeout_s` otherwise; a run passes its deadlines.startup_s and deadlines.engine_call_s).
An engine that dies or misses it raises `RolloutError` naming the engine index and the phase.
`restart(indices)` replaces dead engines with fresh ones in the same slots; a fresh engine
holds the weights of `model_dir` and is in no sync group, so the caller re-forms the group and
syncs it (`mcore_rl.rl.recovery` does). Late engines (`RolloutConfig.startup_engines`)
are the same: `start_late_engines` starts them, `admit_late_engines` adds those that are up,
and the caller re-forms the group and syncs them (`mcore_rl.rl.weight_sync`).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from mcore_rl.config import ConfigError
from mcore_rl.launch.logs import configure_process_logs
from mcore_rl.launch.placement import RAY_NOSET_VISIBLE_DEVICES, restrict_visible_devices
from mcore_rl.launch.watchdog import arm_stack_dump, maybe_stall, still_running
from mcore_rl.rollout.config import RolloutConfig, SamplingConfig
from mcore_rl.rollout.engine import Completion, RolloutEngine
from mcore_rl.rollout.errors import RolloutError
from mcore_rl.rollout.lora import EngineLoRA
from mcore_rl.rollout.sync_client import SyncReport
from mcore_rl.rollout.vllm_env import engine_actor_env

# Engine methods an actor may run on request (besides generate).
_FORWARDED = frozenset({"describe_shards", "check_shapes", "start_join_sync_group",
                        "finish_join_sync_group", "leave_sync_group", "begin_sync",
                        "finish_sync", "sleep", "wake_up", "reset_prefix_cache", "shutdown"})


@dataclass(frozen=True)
class EngineSpec:
    """What every rollout engine of a run is started from, handed to each engine whole; an
    engine reads its own device slots by index.

    call_timeout_s: the deadline of an engine call given none of its own. seed: every
    engine's vLLM seed (a run's `derive_seed(seed, "engine")`). stack_dir: where engines dump
    their stacks on SIGUSR1 (the watchdog). inject_stall: fault injection for watchdog tests
    ("gen@engine<i>"). lora: the policy's adapter is served by vLLM's LoRA
    (`actor.lora.sync: adapter`). routed_experts: completions carry each token's experts
    (`RolloutEngine`). devices: each engine's TP device slots on its node, from the run's
    placement plan (empty without one). narrow_visible_devices (a GPU placement):
    CUDA_VISIBLE_DEVICES is narrowed to an engine's slots before anything touches CUDA, so
    vLLM's TP rank t then computes on cuda:t; with a placement plan the engine's device kind
    is the plan's (a GPU placement: CUDA), never re-derived in the engine."""

    model_dir: str
    cfg: RolloutConfig
    call_timeout_s: float
    seed: int = 0
    stack_dir: str | None = None
    inject_stall: str | None = None
    lora: EngineLoRA | None = None
    routed_experts: bool = False
    devices: tuple[tuple[int, ...], ...] = ()
    narrow_visible_devices: bool = False

    def devices_of(self, index: int) -> list[int] | None:
        return list(self.devices[index]) if self.devices else None


class EngineHost:
    """The Ray actor body: one RolloutEngine (Ray wraps this class with `ray.remote`)."""

    def __init__(self, index: int, spec: EngineSpec):
        """Engine `index` of the run's engines, as `spec` says."""
        if spec.stack_dir:  # the controller's watchdog asks for stacks with SIGUSR1
            configure_process_logs(Path(spec.stack_dir).parent, f"engine{index}")
            self._stack_file = arm_stack_dump(spec.stack_dir, f"engine{index}")
        self.inject_stall = spec.inject_stall
        self.devices = devices = spec.devices_of(index)
        if spec.narrow_visible_devices:
            restrict_visible_devices(devices)
        planned = None if devices is None else ("cuda" if spec.narrow_visible_devices else "cpu")
        self.engine = RolloutEngine(spec.model_dir, spec.cfg, engine_index=index,
                                    call_timeout_s=spec.call_timeout_s, seed=spec.seed,
                                    device=planned, lora=spec.lora,
                                    routed_experts=spec.routed_experts)

    def ready(self) -> dict[str, Any]:
        import ray  # lazy: ray

        context = ray.get_runtime_context()
        return {"startup_s": self.engine.startup_s, "pid": os.getpid(),
                "threads": torch.get_num_threads(),
                "node_id": context.get_node_id(), "devices": self.devices,
                "placement_group": context.get_placement_group_id()}

    def generate(self, prompts, sampling: SamplingConfig, first_index: int,
                 routing_start: list[int] | None = None):
        maybe_stall("gen", f"engine{self.engine.index}", self.inject_stall)
        return self.engine.generate(prompts, sampling, first_index=first_index,
                                    routing_start=routing_start)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in _FORWARDED:
            raise RolloutError(self.engine.index, method, "not an engine method actors run")
        return getattr(self.engine, method)(*args, **kwargs)


class RayEngines:
    """`cfg.engines` rollout engines in Ray actors (Ray must be initialized, e.g. by
    `init_local_ray()`). Blocks until every engine has started or raises naming the one
    that failed — or, with `wait=False`, returns once the actors are created and the caller
    does other start-up work before `wait_ready()`. `startup_s[i]`: engine i's vLLM start-up
    time; `pids[i]`: its process (both empty until the engines are ready)."""

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, start_timeout_s: float,
                 call_timeout_s: float, stack_dir: str | Path | None = None,
                 inject_stall: str | None = None, placement=None, seed: int = 0,
                 wait: bool = True, lora: EngineLoRA | None = None,
                 routed_experts: bool = False):
        """start_timeout_s: how long an engine may take to start. call_timeout_s: the
        deadline of every other call that is given none of its own. seed: every engine's
        vLLM seed (a run's `derive_seed(seed, "engine")`). stack_dir: where engines dump
        their stacks on SIGUSR1 (watchdog).
        inject_stall: fault injection for watchdog tests ("gen@engine<i>").
        placement: a `launch.placement.RayPlacement`: engine i goes into its node's bundle
        and sees only its TP devices (default: anywhere Ray likes).
        lora: every engine serves the policy's LoRA adapter (`rollout.lora.EngineLoRA`).
        routed_experts: every completion carries its tokens' experts (`Completion.routing`).
        """
        import ray  # lazy: ray

        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized: call init_local_ray() or ray.init()")
        for name, value in (("start_timeout_s", start_timeout_s),
                            ("call_timeout_s", call_timeout_s)):
            if not value > 0:
                raise ConfigError(name, value, "must be > 0 seconds")
        self.cfg = cfg
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self._sync_timeout = call_timeout_s
        self._host_cls = ray.remote(num_cpus=cfg.cpus_per_engine, max_restarts=0,
                                    max_concurrency=1)(EngineHost)
        self._placement = placement
        self.spec = EngineSpec(
            str(model_dir), cfg, call_timeout_s, seed=seed,
            stack_dir=str(stack_dir) if stack_dir else None, inject_stall=inject_stall,
            lora=lora, routed_experts=routed_experts,
            devices=(() if placement is None else tuple(
                tuple(slot.device for slot in engine) for engine in placement.plan.engines)),
            narrow_visible_devices=placement is not None and placement.gpu)
        self.startup_s, self.pids, self.where = [], [], []
        # the engines in the run; late ones (cfg.startup_engines) are added by admit_late_engines
        self._actors = [self._start(i) for i in range(cfg.engines_at_startup)]
        # engine -> its call that missed a deadline (shutdown does not wait for it to answer:
        # launch.watchdog.still_running)
        self._unanswered: dict[int, Any] = {}
        # late engines started and not yet admitted: (index, actor, its ready() ref, deadline)
        self._late: list[tuple[int, Any, Any, float]] = []
        self._ready_by = time.monotonic() + start_timeout_s  # the deadline counts from here
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every engine has started, within start_timeout_s of their creation;
        a failure shuts every engine down and raises RolloutError naming the one that
        failed."""
        try:
            info = self._gather("start-up", [(i, a.ready.remote())
                                             for i, a in enumerate(self._actors)],
                                self.start_timeout_s, deadline=self._ready_by)
        except RolloutError:
            self.shutdown()
            raise
        self.startup_s = [r["startup_s"] for r in info]
        self.pids = [r["pid"] for r in info]
        self.where = info  # node, devices, placement group and torch threads of each engine

    def start_late_engines(self) -> None:
        """Start the engines beyond `cfg.startup_engines` (returns at once); they take no calls
        until `admit_late_engines` adds them."""
        for i in range(self.num_engines + len(self._late), self.cfg.engines):
            actor = self._start(i)
            self._late.append((i, actor, actor.ready.remote(),
                               time.monotonic() + self.start_timeout_s))

    @property
    def late_pending(self) -> int:
        """Late engines started and not yet admitted."""
        return len(self._late)

    def admit_late_engines(self, wait: bool = False) -> list[int]:
        """The late engines that are up become engines of the run, in index order (engine i
        + 1 waits for i): generate and sync calls include them from now on, and the caller
        must form a new sync group and sync them. Returns their indices. wait: block until
        every late engine is up. A late engine that failed to start, or is not up within
        start_timeout_s of its start, raises RolloutError naming it (the late engines not yet
        admitted are stopped)."""
        import ray  # lazy: ray

        admitted = []
        while self._late:
            i, actor, ready_ref, deadline = self._late[0]
            timeout = max(0.0, deadline - time.monotonic()) if wait else 0.0
            if not ray.wait([ready_ref], timeout=timeout)[0] and time.monotonic() < deadline:
                break  # still starting: it joins at a later call
            try:  # up (or failed, or late): its reply, or the error naming it
                info = self._gather("start-up", [(i, ready_ref)], self.start_timeout_s,
                                    deadline=deadline)[0]
            except RolloutError:
                self._stop_late()
                raise
            self._late.pop(0)
            self._actors.append(actor)
            self.startup_s.append(info["startup_s"])
            self.pids.append(info["pid"])
            self.where.append(info)
            admitted.append(i)
        return admitted

    def _stop_late(self) -> None:
        import ray  # lazy: ray

        late, self._late = self._late, []
        for _, actor, _, _ in late:
            ray.kill(actor, no_restart=True)

    def _start(self, i: int):
        """Engine i's actor, in its slot of the placement plan (node bundle, TP devices)."""
        options, env = {}, {}
        if self._placement is not None:
            options = self._placement.options_for_node(self._placement.plan.engine_node(i))
            if self.spec.narrow_visible_devices:  # its physical slots: CUDA_VISIBLE_DEVICES

                env.update(RAY_NOSET_VISIBLE_DEVICES)
        env.update(engine_actor_env(self.cfg))
        if env:
            options["runtime_env"] = {"env_vars": env}
        return self._host_cls.options(**options).remote(i, self.spec)

    def restart(self, indices: Sequence[int]) -> None:
        """Replace engines `indices` (dead or broken) with fresh ones in the same slots: the
        old actor is killed (and its processes with it), a new one starts and loads
        `model_dir`. The new engines hold those weights, not the trainer's, and are in no
        sync group. Raises RolloutError naming an engine that fails to start."""
        import ray  # lazy: ray

        for i in indices:
            ray.kill(self._actors[i], no_restart=True)
            self._actors[i] = self._start(i)
            self._unanswered.pop(i, None)
        info = self._gather("start-up", [(i, self._actors[i].ready.remote()) for i in indices],
                            self.start_timeout_s)
        for i, reply in zip(indices, info):
            self.startup_s[i], self.pids[i], self.where[i] = reply["startup_s"], reply["pid"], \
                reply

    def abandon_sync(self, indices: Sequence[int]) -> None:
        """Engines `indices` (alive) drop their sync state after a peer of the group died:
        an install still in flight is waited out (its error is expected and ignored) and the
        group is left, so they can join a new one."""
        import ray  # lazy: ray

        for method in ("finish_sync", "leave_sync_group"):
            refs = [self._actors[i].call.remote(method) for i in indices]
            if refs:  # errors are expected here (the install lost its peers); only wait
                ray.wait(refs, num_returns=len(refs), timeout=self._sync_timeout + 60.0)

    def probe(self, i: int, timeout_s: float = 30.0) -> str | None:
        """None when engine i generates one token, else why not (its process is gone, its
        engine core or a TP worker died, or no answer within `timeout_s`)."""
        one_token = SamplingConfig(temperature=0.0, max_tokens=1, logprobs=False)
        try:
            self._gather("probe", [(i, self._actors[i].generate.remote([[1]], one_token, 0))],
                         timeout_s)
        except RolloutError as err:
            return err.detail
        return None

    @property
    def num_engines(self) -> int:
        return len(self._actors)

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 timeout_s: float | None = None, engines: Sequence[int] | None = None,
                 routing_start: Sequence[int] | None = None) -> list[list[Completion]]:
        """Spread prompts over `engines` (default: all) in contiguous chunks; results in
        prompt order (each prompt's `sampling.n` samples in order). routing_start: per
        prompt, the positions whose routed experts the caller holds (`RolloutEngine`)."""
        use = list(range(self.num_engines)) if engines is None else list(engines)
        if not use or any(not 0 <= i < self.num_engines for i in use):
            raise ValueError(f"engines={engines}: indices must be in [0, {self.num_engines})")
        calls, start = [], 0
        for k, i in enumerate(use):
            stop = start + (len(prompts) - start) // (len(use) - k)
            if stop > start:
                chunk = [list(map(int, p)) for p in prompts[start:stop]]
                starts = None if routing_start is None else list(routing_start[start:stop])
                calls.append((i, self._actors[i].generate.remote(chunk, sampling, start,
                                                                 starts)))
            start = stop
        out: list[list[Completion]] = []
        for part in self._gather("generate", calls, self._timeout(timeout_s)):
            out.extend(part)
        return out

    # ---------------------------------------------------------------- engine calls

    def dead_engines(self, timeout_s: float = 5.0) -> list[int]:
        """Engines whose process is gone or that do not answer within `timeout_s` (used to
        name the culprit when a sync or call fails)."""
        import ray  # lazy: ray
        from ray.exceptions import GetTimeoutError, RayActorError  # lazy: ray

        dead = []
        for i, ref in enumerate([a.ready.remote() for a in self._actors]):
            try:
                ray.get(ref, timeout=timeout_s)
            except (RayActorError, GetTimeoutError):
                dead.append(i)
        return dead

    def _call_all(self, phase: str, method: str, *args: Any, deadline_s: float | None = None,
                  per_engine_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        """`engine.<method>(*args, *per_engine_args[i], **kwargs)` on every engine; replies in
        engine order within `deadline_s` (default call_timeout_s)."""
        calls = []
        for i, actor in enumerate(self._actors):
            extra = per_engine_args[i] if per_engine_args is not None else ()
            calls.append((i, actor.call.remote(method, *args, *extra, **kwargs)))
        return self._gather(phase, calls, self._timeout(deadline_s))

    def describe_shards(self) -> list[list[dict[str, tuple[int, ...]]]]:
        """[engine][tp_rank] → vLLM name → per-rank shape."""
        return self._call_all("describe", "describe_shards")

    def check_shapes(self, plan, first_sync_rank: int) -> None:
        """Every engine's per-rank shapes equal `plan.dst_shapes` of its sync ranks."""
        tp = self.cfg.tp
        self._call_all("describe", "check_shapes", per_engine_args=[
            ([plan.dst_shapes.get(first_sync_rank + i * tp + r, {}) for r in range(tp)],)
            for i in range(self.num_engines)])

    def start_join_sync_group(self, spec, first_sync_rank: int,
                              devices: Sequence[tuple[str, ...]] | None = None,
                              plan=None) -> None:
        """Every engine's workers start joining the sync group (returns at once); the trainer
        then joins and calls `finish_join_sync_group`. devices[i]: engine i's per-TP-rank
        devices (the resolved run's `engine_devices`). plan: the sync plan (the whole model's)
        each worker checks it writes exactly its parameters (`RolloutEngine.
        start_join_sync_group`'s `expected`)."""
        tp = self.cfg.tp
        self._call_all("sync", "start_join_sync_group", spec, per_engine_args=[
            (first_sync_rank + i * tp, devices[i] if devices else None,
             None if plan is None else
             [plan.written(first_sync_rank + i * tp + r) for r in range(tp)])
            for i in range(self.num_engines)])

    def finish_join_sync_group(self, timeout_s: float | None = None) -> None:
        timeout = self._timeout(timeout_s)
        self._call_all("sync", "finish_join_sync_group", timeout, deadline_s=timeout + 15.0)

    def leave_sync_group(self) -> None:
        self._call_all("sync", "leave_sync_group")

    def begin_sync(self, plan, *, dtype: torch.dtype = torch.float32, verify: bool = True,
                   timeout_s: float | None = None, adapter: bool = False) -> None:
        """Start every engine's receive-and-install; returns once all have started.
        timeout_s: the workers' receive deadline (default call_timeout_s). adapter: the plan
        carries the policy's LoRA adapter (`RolloutEngine.begin_sync`)."""
        self._sync_timeout = self._timeout(timeout_s)
        self._call_all("sync", "begin_sync", plan, dtype=dtype, verify=verify,
                       timeout_s=self._sync_timeout, adapter=adapter)

    def finish_sync(self, timeout_s: float | None = None) -> list[SyncReport]:
        """Wait for every engine's install, check names, reset prefix caches. timeout_s: how
        long each engine waits for its workers (default: their receive deadline + 20 s)."""
        deadline = (timeout_s if timeout_s is not None else self._sync_timeout + 20.0) + 30.0
        return self._call_all("sync", "finish_sync", timeout_s=timeout_s, deadline_s=deadline)

    def sleep(self) -> None:
        """Colocated training: free GPU memory (enable_sleep); a no-op on CPU."""
        self._call_all("sleep", "sleep")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep` for `tags` ("weights", "kv_cache"; None: all) on every engine."""
        self._call_all("wake-up", "wake_up", None if tags is None else list(tags))

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop every engine and kill its actor. An engine with TP worker processes (tp > 1,
        vLLM's "mp" executor) is first shut down cleanly when it answers within `grace_s`;
        a one-process engine (tp 1, vLLM's "uni" executor in the actor) is killed at once:
        its clean shutdown would only tear down torch.distributed and collect garbage (about
        a second on vLLM's heap) in a process the kill ends anyway. An engine still inside a
        call that missed its deadline is killed at once: it would take the shutdown only
        after that call."""
        import ray  # lazy: ray

        if getattr(self, "_late", None):
            self._stop_late()  # still starting (or never admitted): nothing to close cleanly
        actors, self._actors = getattr(self, "_actors", []), []
        stuck = still_running(getattr(self, "_unanswered", {}))
        refs = [a.call.remote("shutdown") for i, a in enumerate(actors)
                if self.cfg.tp > 1 and i not in stuck]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for actor in actors:
            ray.kill(actor, no_restart=True)

    # ---------------------------------------------------------------- plumbing

    def _timeout(self, timeout_s: float | None) -> float:
        return self.call_timeout_s if timeout_s is None else timeout_s

    def _gather(self, phase: str, calls: list[tuple[int, Any]], timeout_s: float, *,
                deadline: float | None = None) -> list[Any]:
        """Results of `calls` ([(engine, ObjectRef)]) in order; the first failure or the
        deadline (`timeout_s` from now, or the monotonic time `deadline` of a wait that
        began earlier) raises RolloutError naming the engine(s) and the phase."""
        import ray  # lazy: ray
        from ray.exceptions import RayActorError, RayError, RayTaskError  # lazy: ray

        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        engine_of = {ref: i for i, ref in calls}
        results: dict[Any, Any] = {}
        pending = [ref for _, ref in calls]
        while pending:
            remaining = deadline - time.monotonic()
            ready = []
            if remaining > 0:
                ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = sorted(engine_of[r] for r in pending)
                self._unanswered.update((engine_of[r], r) for r in pending)
                raise RolloutError(late[0], phase, f"no reply within {timeout_s:.1f} s "
                                   f"(engines without a reply: {late}); the engine is stuck "
                                   "or overloaded")
            for ref in ready:
                i = engine_of[ref]
                try:
                    results[ref] = ray.get(ref)
                except RayActorError as err:
                    raise RolloutError(i, phase, _actor_error(err)) from err
                except RayTaskError as err:
                    cause = getattr(err, "cause", None)
                    if isinstance(cause, RolloutError):
                        raise RolloutError(cause.engine, cause.phase, cause.detail,
                                           cause.rank) from err
                    raise RolloutError(i, phase, f"{type(cause).__name__ if cause else 'error'}:"
                                                 f" {cause if cause else _first_line(err)}") \
                        from err
                except RayError as err:  # e.g. OutOfMemoryError: Ray's memory monitor killed it
                    raise RolloutError(i, phase, f"{type(err).__name__}: {_first_line(err)}") \
                        from err
        return [results[ref] for _, ref in calls]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_OUR_ERROR = re.compile(r"^(?:[\w.]+\.)?RolloutError: rollout engine \d+(?: tp rank \d+)?, "
                        r"[\w-]+: ")


def _first_line(err: BaseException) -> str:
    text = _ANSI.sub("", str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _actor_error(err: BaseException) -> str:
    """A dead actor's error in one line: the exception its constructor raised, if it was
    that (Ray puts it last in the message), else Ray's own first line."""
    lines = [line.strip() for line in _ANSI.sub("", str(err)).splitlines() if line.strip()]
    if getattr(err, "_actor_init_failed", False) and len(lines) > 1:
        return "failed to start: " + _OUR_ERROR.sub("", lines[-1])
    return "engine process died: " + (lines[0] if lines else type(err).__name__)


__all__ = ["EngineHost", "RayEngines"]
