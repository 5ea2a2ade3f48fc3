"""Knobs that make a run fit: each a change of the run config (RLConfig overrides such as
`actor.sequence_parallel=true`), re-estimated by the memory planner with the change applied."""

from __future__ import annotations

import dataclasses

from mcore_rl.config import ConfigError
from mcore_rl.models.spec import ModelSpec
from mcore_rl.planning.memory import MemoryPlan, Suggestion, plan_memory
from mcore_rl.planning.sized import SizedRun, with_overrides


def _train_knob(run: SizedRun, field: str, value) -> list[str]:
    """One training knob for every training role: the actor's `train` and, with a critic, its
    `critic_train`."""
    roles = ["train"] + (["critic_train"] if run.critic else [])
    return [f"{role}.{field}={value}" for role in roles]


Knob = tuple[str, list[str], str]


def _candidates(run: SizedRun, spec: ModelSpec) -> list[Knob]:
    """(knob, overrides, note) — each changes one thing, keeping the number of devices where
    the knob allows it."""
    return _trainer_knobs(run) + _grid_knobs(run, spec) + _rollout_knobs(run, spec)


def _trainer_knobs(run: SizedRun) -> list[Knob]:
    """Smaller micro batches, more recomputation, the distributed optimizer, SP."""
    t, par = run.cfg.train, run.cfg.actor
    out: list[Knob] = []
    mb = t.micro_batch_size
    while mb > 1:
        mb //= 2
        out.append((f"micro batch {mb}", _train_knob(run, "micro_batch_size", mb), ""))
    order = ["none", "selective", "full"]
    for level in order[order.index(t.recompute) + 1 :]:
        out.append((f"{level} recompute", _train_knob(run, "recompute", level), ""))
    if par.dp > 1 and not par.use_distributed_optimizer:
        out.append(("distributed optimizer", ["actor.use_distributed_optimizer=true"], ""))
    if par.tp > 1 and not par.sequence_parallel:
        out.append(("sequence parallel", ["actor.sequence_parallel=true"], ""))
    return out


def _grid_knobs(run: SizedRun, spec: ModelSpec) -> list[Knob]:
    """The actor's TP or PP doubled (its DP halved where it splits)."""
    par, gpn = run.cfg.actor, run.cluster.gpus_per_node
    out: list[Knob] = []
    dp = par.dp // 2 if par.dp % 2 == 0 else par.dp
    tp2 = par.tp * 2
    if spec.heads % tp2 == 0 and spec.kv_heads % tp2 == 0 and spec.ffn % tp2 == 0 and tp2 <= gpn:
        note = "same devices" if dp != par.dp else f"needs {tp2 * par.pp * dp} training devices"
        out.append((f"actor tp {tp2}", [f"actor.tp={tp2}", f"actor.dp={dp}"], note))
    pp2 = par.pp * 2
    if (
        par.first_stage_layers is None
        and par.last_stage_layers is None
        and spec.layers % (pp2 * (par.vpp or 1)) == 0
    ):
        note = "same devices" if dp != par.dp else f"needs {par.tp * pp2 * dp} training devices"
        out.append((f"actor pp {pp2}", [f"actor.pp={pp2}", f"actor.dp={dp}"], note))
    return out


def _rollout_knobs(run: SizedRun, spec: ModelSpec) -> list[Knob]:
    """A smaller engine memory share (GPU) or KV cache (CPU), or the engines' TP doubled."""
    r, gpn, util = run.cfg.rollout, run.cluster.gpus_per_node, run.gpu_memory_utilization
    out: list[Knob] = []
    if run.cluster.placement == "colocated" and util is not None and util > 0.1:
        for new in (round(util - 0.1 * k, 2) for k in range(1, 9)):
            if new >= 0.1:
                out.append(
                    (
                        f"gpu_memory_utilization {new:g}",
                        [f"rollout.gpu_memory_utilization={new:g}"],
                        "",
                    )
                )
    if util is None:  # CPU: the KV cache is what the engine is given
        half = r.kv_cache_gib / 2
        out.append((f"kv_cache_gib {half:g}", [f"rollout.kv_cache_gib={half:g}"], ""))
    rtp = r.tp * 2
    if (
        spec.heads % rtp == 0
        and rtp <= gpn
        and (spec.kv_heads % rtp == 0 or rtp % spec.kv_heads == 0)
    ):
        engines = r.engines // 2 if r.engines % 2 == 0 else r.engines
        out.append(
            (
                f"rollout tp {rtp}",
                [f"rollout.tp={rtp}", f"rollout.engines={engines}"],
                "same devices" if engines != r.engines else "more devices",
            )
        )
    return out


def _try(run: SizedRun, overrides: list[str]) -> MemoryPlan | None:
    try:
        return plan_memory(with_overrides(run, overrides))
    except (ConfigError, ValueError):
        return None


def suggest(plan: MemoryPlan, *, max_steps: int = 6) -> tuple[Suggestion, ...]:
    """For a plan that does not fit: each knob alone (re-estimated with the knob changed; for
    stepwise knobs the mildest setting that fits, else the strongest), then a greedy
    combination (repeatedly the single knob that lowers the peak most) until it fits."""
    run = plan.run
    spec = run.spec
    singles: dict[str, Suggestion] = {}
    for knob, overrides, note in _candidates(run, spec):
        family = knob.rsplit(" ", 1)[0] if knob.startswith(("micro batch", "gpu_memory")) else knob
        if family in singles and singles[family].fits:
            continue  # a milder step of this knob already fits
        trial = _try(run, overrides)
        if trial is None or trial.peak_bytes >= plan.peak_bytes:
            continue
        singles[family] = Suggestion(knob, tuple(overrides), trial.peak_bytes, trial.fits, note)
    out = sorted(singles.values(), key=lambda s: (not s.fits, s.peak_bytes))
    if not any(s.fits for s in out):
        combo: list[str] = []
        current, knobs, notes = plan, [], []
        for _ in range(max_steps):
            best = None
            for knob, overrides, note in _candidates(current.run, spec):
                trial = _try(current.run, overrides)
                if (
                    trial is not None
                    and trial.peak_bytes < current.peak_bytes
                    and (best is None or trial.peak_bytes < best[1].peak_bytes)
                ):
                    best = (knob, trial, overrides, note)
            if best is None:
                break
            knobs.append(best[0])
            combo += best[2]
            current = best[1]
            if best[3] and best[3] != "same devices":
                notes.append(best[3])
            if current.fits:
                break
        if knobs:
            out.append(
                Suggestion(
                    " + ".join(knobs),
                    tuple(combo),
                    current.peak_bytes,
                    current.fits,
                    "; ".join(["combined"] + notes),
                )
            )
    return tuple(out)


def plan_with_suggestions(run: SizedRun) -> MemoryPlan:
    plan = plan_memory(run)
    if plan.fits:
        return plan
    return dataclasses.replace(plan, suggestions=suggest(plan))


__all__ = ["plan_with_suggestions", "suggest"]
