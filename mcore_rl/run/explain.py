"""`mcore-rl explain CONFIG [a.b=c ...] [--assume-gpu]`: what the run will do on this machine
(or on an assumed GPU machine) — the resolved run (`mcore_rl.planning.resolve.ResolvedRun`)
the controller hands to every worker, printed as tables, and as the last line one JSON object
(`ResolvedRun.summary()`: at least layer_spec, sync_backend, transports — one per engine).

Nothing is started and nothing is downloaded: the same pure resolution the controller runs.
A run preflight's grid checks refuse (`planning.grid_checks.GRID_CHECKS`: a TP that does not
divide the heads, more ranks than devices, ...) is not drawn: each problem is one line on
stderr, as preflight words it, and the exit code is 2 (`CONFIG_ERROR_EXIT`), as for a config
that does not load.
"""

from __future__ import annotations

import argparse
import json
import sys

from mcore_rl.config import CONFIG_ERROR_EXIT, ConfigError

LAYER_SPECS = {"te": "te (TransformerEngine: fused norm + linear names, flash attention)",
               "local": "local (megatron's pure-PyTorch layers and names)"}
# "ipc": the engine's ranks share devices with actor ranks (CUDA IPC on GPU, shared memory on
# CPU); "p2p": sends and receives over the sync group.
TRANSPORTS = {"p2p": "p2p (sync group)", "ipc": "ipc (devices shared with actor ranks)"}
# rollout.expert_parallel (MoE models only: a dense model has no experts to place)
EXPERTS = {False: "split over TP (every engine rank holds a slice of every expert)",
           True: "expert parallel (each engine rank holds whole experts, vLLM's linear "
                 "placement)"}
START_UP = {True: "trainers first, then the engines (devices shared: vLLM sizes itself "
                  "against the free memory it measures at start-up)",
            False: "trainers and engines together"}


def hosted_roles(cfg) -> str:
    """What the actor ranks host besides the policy, and where the reward model runs."""
    roles = [name for name, on in (
        ("critic (GAE)", cfg.algorithm.advantage_estimator == "gae"),
        ("reference policy (KL)", cfg.algorithm.kl_coeff > 0)) if on]
    hosted = (" and ".join(roles) + " on the actor ranks' devices, beside the policy"
              if roles else "the policy only")
    if cfg.reward_model.enabled:
        hosted += ("; reward model: its own ranks on the actor ranks' devices "
                   f"(tp {cfg.reward_model.parallel.tp})")
    return hosted


def add_parser(sub: argparse._SubParsersAction) -> None:
    from mcore_rl.run.plan_cli import add_assume_gpu

    p = sub.add_parser("explain", help="what a run config will run here: device, layer spec, "
                                       "sync backend, transports, devices per rank")
    p.add_argument("config", help="run config YAML (e.g. configs/gpu/llama3-70b.yaml)")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    add_assume_gpu(p)
    p.set_defaults(func=run_explain)


def _where(slot, device: str) -> str:
    return f"node {slot.node} · {device}"


def render(run, title: str, *, moe: bool, roles: str):
    """The resolved run as rich renderables: the run, its engines, its actor ranks. moe: the
    model has experts (the engines' expert placement is shown); roles: `hosted_roles`."""
    from rich.table import Table

    c = run.cluster
    facts = Table(title=title, show_header=False, title_justify="left")
    facts.add_column("what", style="bold")
    facts.add_column("resolved")
    for what, value in (
            ("device", run.device),
            ("layer spec", LAYER_SPECS[run.layer_spec]),
            ("sync backend", run.sync_backend),
            ("placement", f"{run.placement.placement}: {run.placement.nodes} node(s) × "
                          f"{run.placement.devices_per_node} devices"),
            ("allocation", f"{c.nodes} × {c.gpus_per_node} {c.device}, {c.device_gib:g} GiB "
                           f"each ({c.reserve_gib:g} reserved)"),
            ("dtypes", f"actor params {run.param_dtype} · engines {run.rollout_dtype} · "
                       f"weight sync {run.wire_dtype}"),
            ("start-up", START_UP[run.trainers_first]),
            ("roles", roles),
            *([("vLLM experts", EXPERTS[run.expert_parallel])] if moe else [])):
        facts.add_row(what, value)
    engines = Table(title="engines", title_justify="left")
    for name in ("engine", "tp", "transport", "devices (tp rank order)"):
        engines.add_column(name)
    for e, (slots, devices) in enumerate(zip(run.placement.engines, run.engine_devices)):
        engines.add_row(str(e), str(len(slots)), TRANSPORTS[run.transports[e]],
                        ", ".join(_where(s, d) for s, d in zip(slots, devices)))
    actor = Table(title="actor ranks", title_justify="left")
    for name in ("rank", "device"):
        actor.add_column(name)
    for r, (slot, device) in enumerate(zip(run.placement.actor, run.actor_devices)):
        actor.add_row(str(r), _where(slot, device))
    return facts, engines, actor


def run_explain(args) -> int:
    """Exit 0 with the resolved run; 2 when the config does not load, fails a grid check
    or cannot be placed."""
    from rich.console import Console

    from mcore_rl.config import load_config
    from mcore_rl.planning.grid_checks import GRID_CHECKS, preflight
    from mcore_rl.planning.resolve import resolve_run
    from mcore_rl.planning.sized import sized_run
    from mcore_rl.run.config import RLConfig

    try:
        cfg = load_config(RLConfig, args.config, list(args.overrides))
        sized = sized_run(cfg, assume_gpu=args.assume_gpu)
        errors = [p for p in preflight(sized, only=GRID_CHECKS) if p.severity == "error"]
        if not errors:
            run = resolve_run(cfg, assume_gpu=args.assume_gpu)
    except ConfigError as err:
        print(f"mcore-rl explain: config error: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    for p in errors:
        print(f"mcore-rl explain: [{p.check}] {p.message} (fix: {p.fix})", file=sys.stderr)
    if errors:
        return CONFIG_ERROR_EXIT
    how = " (GPU assumed)" if args.assume_gpu else ""
    console = Console(width=120, soft_wrap=False)
    for table in render(run, f"{args.config}{how}: what will run", moe=sized.spec.is_moe,
                        roles=hosted_roles(cfg)):
        console.print(table)
    sys.stdout.flush()
    from mcore_rl.planning.sync_traffic import explain_traffic

    # one sync's bytes per engine by transport, from the real plan (IPC never crosses a node)
    print(json.dumps({**run.summary(), **explain_traffic(cfg, run)}, separators=(",", ":")))
    return 0


__all__ = ["add_parser", "render", "run_explain"]
