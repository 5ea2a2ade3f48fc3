"""A memory plan as text (`mcore-rl plan-memory`) and as JSON (`--json`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mcore_rl.config import to_dict
from mcore_rl.planning.memory import MemoryPlan
from mcore_rl.planning.sized import GiB, SizedRun


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def describe(run: SizedRun) -> str:
    """One line: the model, the allocation as sized, the grids and the batch."""
    c, t, par, r = run.cluster, run.cfg.train, run.cfg.actor, run.cfg.rollout
    grid = f"tp{par.tp} pp{par.pp}" + (f" vpp{par.vpp}" if par.vpp else "") + f" dp{par.dp}"
    flags = [
        f
        for f, on in (("SP", par.sequence_parallel), ("dist-opt", par.use_distributed_optimizer))
        if on
    ]
    return (
        f"{run.model_name} · {c.placement} · {c.nodes}×{c.gpus_per_node} "
        f"{c.device} ({c.device_gib:g} GiB) · actor {grid}"
        f"{' (' + ', '.join(flags) + ')' if flags else ''} · mb {t.micro_batch_size} × "
        f"seq {t.seq_len}, {t.dtype}, {t.recompute} recompute · rollout {r.engines}×tp{r.tp}"
    )


def format_plan(plan: MemoryPlan) -> str:
    lines = [describe(plan.run), ""]
    for rank in plan.roles:
        lines.append(f"{rank.role} ({rank.where})")
        for c in rank.components:
            lines.append(f"  {c.name:<22}{_gib(c.bytes):>13}  {c.detail}")
        lines.append(f"  {'total':<22}{_gib(rank.total):>13}")
        lines.append("")
    limit = plan.device_bytes
    for dev in plan.devices:
        lines.append(f"{dev.device}")
        for phase in dev.phases:
            ok = "fits" if phase.total <= limit else "DOES NOT FIT"
            parts = " + ".join(f"{what} {b / GiB:.2f}" for what, b in phase.parts)
            lines.append(f"  {phase.name:<36}{_gib(phase.total):>13}  {ok}   ({parts})")
        lines.append("")
    for note in plan.notes:
        lines.append(f"note: {note}")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"peak {_gib(plan.peak_bytes)} of {plan.run.cluster.device_gib:g} GiB "
        f"({plan.worst.device}, {plan.worst.peak.name}): {verdict}"
    )
    if plan.suggestions:
        lines.append("knobs (peak of the worst device with the change):")
        for s in plan.suggestions:
            tag = "fits" if s.fits else "still too big"
            note = f"  [{s.note}]" if s.note else ""
            lines.append(
                f"  {s.knob:<34}{_gib(s.peak_bytes):>13}  {tag}   {' '.join(s.overrides)}{note}"
            )
    return "\n".join(lines)


def plan_to_json(plan: MemoryPlan) -> dict[str, Any]:
    run = plan.run
    return {
        "model": run.model_name,
        "device": run.device,
        "kernels": run.kernels,
        "cluster": to_dict(run.cluster),
        "roles": [
            {
                "role": r.role,
                "where": r.where,
                "total_bytes": r.total,
                "components": [
                    {"name": c.name, "bytes": c.bytes, "detail": c.detail, "resident": c.resident}
                    for c in r.components
                ],
            }
            for r in plan.roles
        ],
        "devices": [
            {
                "device": d.device,
                "phases": [
                    {"name": p.name, "total_bytes": p.total, "parts": dict(p.parts)}
                    for p in d.phases
                ],
            }
            for d in plan.devices
        ],
        "peak_bytes": plan.peak_bytes,
        "device_bytes": plan.device_bytes,
        "fits": plan.fits,
        "notes": list(plan.notes),
        "suggestions": [dataclasses.asdict(s) for s in plan.suggestions],
    }


__all__ = ["describe", "format_plan", "plan_to_json"]
