"""Preflight: check a `RunShape` (built from the user's RLConfig by
`mcore_rl.trainer.preflight`, which also renames the fields in the texts to the RLConfig's)
against the model, the hardware and itself before launch, and
list every problem at once, each with its fix.

Each check is one row of `CHECKS` (a stable id and a function yielding `Problem`s); every check
runs even when others fail, so a user fixes a config in one round trip instead of one crash at
a time. Errors are what would crash, hang or OOM the run; warnings are what only slows it.

Known-good process modes (shared/FINDINGS.md): on CPU the sync group is gloo and vLLM runs
in-process ("uni") at tp 1 or with its "mp" executor at tp > 1 — the "ray" executor is refused
on CPU; on GPU the sync backend is nccl, and an engine spans nodes only with the "ray" executor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Literal

from mcore_rl.config import ConfigError
from mcore_rl.layouts.shards import LayoutError, validate_megatron_grid, vllm_shards
from mcore_rl.models.spec import ModelSpec
from mcore_rl.planning.memory import MemoryPlan, plan_memory, suggest
from mcore_rl.planning.run_shape import GiB, RunShape


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a run: `check` (stable id), what is wrong, how to fix it."""

    check: str
    message: str
    fix: str
    severity: Literal["error", "warning"] = "error"


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def _fmt(values: Iterable[int]) -> str:
    return ", ".join(map(str, values)) or "none"


# --- checks -----------------------------------------------------------------------------------


def check_train_tp(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    par = shape.train.parallel
    try:  # the tensor split only: the pipeline split is check_train_pp's
        validate_megatron_grid(spec, replace(par, pp=1, vpp=None, first_stage_layers=None,
                                             last_stage_layers=None))
    except LayoutError as err:
        good = _divisors(math.gcd(spec.heads, spec.kv_heads, spec.ffn), shape.gpus_per_node)
        yield Problem("train-tp", str(err), f"train.parallel.tp one of {_fmt(good)} (divides "
                      f"heads={spec.heads}, kv heads={spec.kv_heads}, ffn={spec.ffn})")
    except ConfigError:
        pass  # the pipeline split: check_train_pp
    if par.tp > shape.gpus_per_node:
        yield Problem("train-tp-node", f"train.parallel.tp={par.tp} spans nodes "
                      f"(gpus_per_node={shape.gpus_per_node}): every layer all-reduces across "
                      "the inter-node network", f"train.parallel.tp <= {shape.gpus_per_node}; "
                      "use pp for the rest", "warning")


def check_train_pp(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    par = shape.train.parallel
    try:
        par.stage_layer_counts(spec.layers)
    except ConfigError as err:
        chunks = par.vpp or 1
        good = [p for p in _divisors(spec.layers // chunks if spec.layers % chunks == 0
                                     else spec.layers) if spec.layers % (p * chunks) == 0]
        fix = (f"train.parallel.pp one of {_fmt(good)} for {spec.layers} layers"
               + (f" with vpp={par.vpp}" if par.vpp else ""))
        if par.first_stage_layers is not None or par.last_stage_layers is not None:
            fix = ("first_stage_layers + last_stage_layers + (pp - 2) · k must equal "
                   f"{spec.layers} layers for a whole k >= 1; or " + fix)
        yield Problem("train-pp", str(err.under("train.parallel")), fix)


def check_batch(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    t, par = shape.train, shape.train.parallel
    per_step = t.micro_batch_size * par.dp
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        yield Problem("train-batch", f"train.global_batch_size={t.global_batch_size} is not a "
                      f"multiple of micro_batch_size × dp = {t.micro_batch_size} × {par.dp}",
                      f"train.global_batch_size={lo} or {lo + per_step}, or change "
                      "micro_batch_size / dp")
        return
    m = t.global_batch_size // per_step
    if par.vpp is not None and m % par.pp:
        yield Problem("train-batch-vpp", f"{m} micro batches per step and DP rank: "
                      f"interleaved pipelining needs a multiple of pp={par.pp}",
                      f"train.global_batch_size a multiple of {per_step * par.pp}")
    if par.pp > 1 and m < par.pp:
        yield Problem("train-pipeline-bubble", f"{m} micro batches per step < pp={par.pp}: "
                      "most of every step is pipeline bubble",
                      f"train.global_batch_size >= {per_step * par.pp * 4} (4 × pp micro batches)",
                      "warning")


def check_seq_len(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    t, par = shape.train, shape.train.parallel
    if t.seq_len > spec.max_positions:
        yield Problem("seq-len", f"train.seq_len={t.seq_len} exceeds the model's "
                      f"max_position_embeddings={spec.max_positions}",
                      f"train.seq_len <= {spec.max_positions}")
    if par.sequence_parallel and t.seq_len % par.tp:
        yield Problem("seq-len-sp", f"train.seq_len={t.seq_len}: sequence parallelism splits "
                      f"it over tp={par.tp}", f"train.seq_len a multiple of {par.tp}")


def _world_fixes(shape: RunShape, train_devices: int) -> str:
    """Ways to give the training grid exactly `train_devices` devices, or the devices it has."""
    par = shape.train.parallel
    fixes = []
    if train_devices % (par.tp * par.pp) == 0 and train_devices:
        fixes.append(f"train.parallel.dp={train_devices // (par.tp * par.pp)}")
    return " or ".join(fixes) or (f"a training grid of {train_devices} devices "
                                  f"(tp·pp = {par.tp * par.pp} does not divide it)")


def check_world(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    train_world, roll = shape.train.parallel.world_size, shape.rollout.world_size
    have, gpn, r = shape.total_devices, shape.gpus_per_node, shape.rollout
    what = f"nodes × gpus_per_node = {shape.nodes} × {gpn} = {have}"
    if shape.placement == "colocated":  # every device: one training rank, one engine rank
        if train_world != have:
            fix = _world_fixes(shape, have)
            if train_world % gpn == 0:
                fix += f", or nodes={train_world // gpn}"
            yield Problem("world-size", f"colocated: training world tp·pp·dp = {train_world} "
                          f"!= {what}", fix)
        if roll != have:
            fix = (f"rollout.engines={have // r.tp}" if have % r.tp == 0 else
                   f"rollout.tp dividing {have}")
            yield Problem("world-size-rollout", f"colocated: rollout engines × tp = "
                          f"{r.engines} × {r.tp} = {roll} != {what} (one engine rank per "
                          "device)", fix)
        return
    need = train_world + roll
    if need != have:
        fixes = [f"nodes={need // gpn}"] if need % gpn == 0 else []
        if have > roll:
            fixes.append(_world_fixes(shape, have - roll))
        if have > train_world and (have - train_world) % r.tp == 0:
            fixes.append(f"rollout.engines={(have - train_world) // r.tp}")
        yield Problem("world-size", f"disaggregated: training {train_world} + rollout "
                      f"{r.engines} × {r.tp} = {need} devices != {what}",
                      " or ".join(fixes) or f"{need} devices in whole nodes")


def check_rollout_tp(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    r = shape.rollout
    try:
        vllm_shards(spec, r.tp, 1)
    except LayoutError as err:
        good = [t for t in _divisors(spec.heads, shape.gpus_per_node)
                if spec.kv_heads % t == 0 or t % spec.kv_heads == 0]
        yield Problem("rollout-tp", f"rollout: {err}", f"rollout.tp one of {_fmt(good)}")
    if r.tp > shape.gpus_per_node and r.executor != "ray":
        yield Problem("rollout-tp-node", f"rollout.tp={r.tp} > gpus_per_node="
                      f"{shape.gpus_per_node}: the {r.executor!r} executor runs an engine on one "
                      "node", f"rollout.tp <= {shape.gpus_per_node}"
                      + (", or rollout.executor=ray" if shape.device == "gpu" else ""))
    elif r.tp <= shape.gpus_per_node and shape.gpus_per_node % r.tp and r.executor != "ray":
        yield Problem("rollout-tp-node", f"rollout.tp={r.tp} does not divide gpus_per_node="
                      f"{shape.gpus_per_node}: some engines would straddle two nodes",
                      f"rollout.tp one of {_fmt(_divisors(shape.gpus_per_node))}")


def check_executor(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    r = shape.rollout
    if r.executor == "uni" and r.tp > 1:
        yield Problem("rollout-executor", f"rollout.executor=uni runs one in-process worker; "
                      f"rollout.tp={r.tp} needs one process per TP rank",
                      "rollout.executor=mp" + (" (or ray)" if shape.device == "gpu" else ""))
    if shape.device == "cpu" and r.executor == "ray":
        yield Problem("rollout-executor", "rollout.executor=ray: vLLM refuses the ray executor "
                      "on CPU (run engines inside Ray actors instead; their TP workers use mp)",
                      "rollout.executor=" + ("mp" if r.tp > 1 else "uni"))
    if shape.device == "cpu" and r.executor == "mp" and r.tp == 1:
        yield Problem("rollout-executor", "rollout.executor=mp at tp=1 on CPU: a worker process "
                      "for nothing (start-up 20-36 s vs 2-5 s in-process)",
                      "rollout.executor=uni", "warning")


def check_sync_backend(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    want = "nccl" if shape.device == "gpu" else "gloo"
    if shape.sync_backend != want:
        why = ("NCCL needs CUDA devices" if shape.device == "cpu" else
               "gloo would stage every weight through host memory at each sync")
        yield Problem("sync-backend", f"sync_backend={shape.sync_backend} on {shape.device}: "
                      f"{why}", f"sync_backend={want}")


def check_cpu_engine(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    if shape.device == "cpu" and not 32 <= spec.head_dim <= 512:
        yield Problem("cpu-head-dim", f"head_dim={spec.head_dim}: vLLM's CPU attention supports "
                      "head sizes 32-512", "a model with head_dim >= 32 (e.g. fewer, wider "
                      "heads)")


def check_reward_model(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    """The reward model's grid fits its model, and its ranks fit on the training devices
    (one reward rank per actor device at most)."""
    rm = shape.reward_model
    if rm is None:
        return
    try:
        rm.parallel.check_model(rm.spec())
    except ConfigError as err:
        yield Problem("reward-model-grid", str(err.under("reward_model.parallel")),
                      "a reward_model.parallel grid that divides the reward model's heads, "
                      "kv heads, FFN and layers")
    train_world = shape.train.parallel.world_size
    if rm.parallel.world_size > train_world:
        yield Problem("reward-model-world", f"reward_model.parallel world "
                      f"{rm.parallel.world_size} > the actor's {train_world} devices (reward "
                      "ranks share the actor's devices, one each)",
                      f"reward_model.parallel with tp·pp·dp <= {train_world}")


def check_memory(shape: RunShape, spec: ModelSpec) -> Iterable[Problem]:
    try:
        plan = plan_memory(shape)
    except (ConfigError, LayoutError, ValueError) as err:
        yield Problem("memory", f"memory not estimated: {err}", "fix the problems above first",
                      "warning")
        return
    yield from memory_problems(plan)


def memory_problems(plan: MemoryPlan) -> Iterable[Problem]:
    shape = plan.shape
    limit = plan.device_bytes
    for note in plan.notes:
        if "refuses to start" in note or "leaves no KV cache" in note:
            yield Problem("rollout-kv", note, "a higher rollout.tp (less weight per device), a "
                          "higher rollout.gpu_memory_utilization, or a shorter train.seq_len")
        elif "preempts" in note:
            yield Problem("rollout-kv", note, "rollout.max_num_seqs lower, or more KV memory",
                          "warning")
    over = [dev for dev in plan.devices if dev.peak.total > limit]
    if not over:
        return
    fitting = [s for s in suggest(plan) if s.fits][:4]
    fix = "; ".join(f"{' '.join(s.overrides)} → {s.peak_bytes / GiB:.1f} GiB"
                    + (f" ({s.note.removeprefix('combined').lstrip('; ')})"
                       if s.note.removeprefix("combined").lstrip("; ") else "")
                    for s in fitting) or "no knob fits; see `mcore-rl plan-memory`"
    util = shape.rollout.gpu_memory_utilization
    for dev in over:
        phase = dev.peak
        parts = ", ".join(f"{what} {b / GiB:.1f}" for what, b in phase.parts)
        others = [p.name for p in dev.phases if p.total > limit and p is not phase]
        message = (f"{dev.device}, {phase.name}: {phase.total / GiB:.1f} GiB > "
                   f"device_gib={shape.device_gib:g} ({parts})"
                   + (f"; also over in: {', '.join(others)}" if others else ""))
        if shape.placement == "colocated" and phase.name == "rollout" and util is not None:
            rest = sum(b for what, b in phase.parts if what != "rollout engine")
            max_util = math.floor((limit - rest) / limit * 100) / 100
            yield Problem("colocated-gpu-util", message + f": vLLM asks for {util:g} of the "
                          "device while the trainer's states stay resident",
                          f"rollout.gpu_memory_utilization <= {max_util:g}" if max_util > 0
                          else fix)
        else:
            yield Problem("memory", message, fix)


CHECKS: tuple[tuple[str, Callable[[RunShape, ModelSpec], Iterable[Problem]]], ...] = (
    ("train-tp", check_train_tp),
    ("train-pp", check_train_pp),
    ("train-batch", check_batch),
    ("seq-len", check_seq_len),
    ("world-size", check_world),
    ("rollout-tp", check_rollout_tp),
    ("rollout-executor", check_executor),
    ("sync-backend", check_sync_backend),
    ("cpu-head-dim", check_cpu_engine),
    ("reward-model", check_reward_model),
    ("memory", check_memory),
)


def preflight(shape: RunShape) -> list[Problem]:
    """Every problem of `shape` (errors and warnings), in CHECKS order."""
    spec = shape.spec()
    problems: list[Problem] = []
    for name, check in CHECKS:
        try:
            problems.extend(check(shape, spec))
        except Exception as err:  # noqa: BLE001 — one broken check must not hide the others
            problems.append(Problem(name, f"check crashed: {type(err).__name__}: {err}",
                                    "report this as a bug in mcore_rl.planning.preflight"))
    return problems


def format_problems(problems: list[Problem]) -> str:
    errors = [p for p in problems if p.severity == "error"]
    lines = [f"{len(errors)} error(s), {len(problems) - len(errors)} warning(s)"]
    for p in sorted(problems, key=lambda p: p.severity != "error"):
        mark = "ERROR" if p.severity == "error" else "warn "
        lines.append(f"{mark} [{p.check}] {p.message}")
        lines.append(f"      fix: {p.fix}")
    return "\n".join(lines)


__all__ = ["CHECKS", "Problem", "format_problems", "preflight"]
