"""`mcore-rl explain CONFIG [a.b=c ...] [--assume-gpu] [--ranks] [--json]`: what the run
will do on this machine (or on an assumed GPU machine) — the resolved run
(`mcore_rl.runconfig.resolve.ResolvedRun`) the controller hands to every worker.

By default one short table: the run's shape (model, algorithm, batch, lengths), how it is
resolved (device, layer spec, sync backend, dtypes, start-up order, roles) and its devices
grouped by role. `--ranks` adds a row per engine and per actor rank. `--json` prints only one
JSON object (`ResolvedRun.summary()` and one sync's bytes per engine by transport) — for
scripts.

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

from rich.console import Console
from rich.table import Table

from mcore_rl.config import CONFIG_ERROR_EXIT, ConfigError, load_config
from mcore_rl.models.kernels import resolve_kernels
from mcore_rl.models.spec import grouped_expert_gemm
from mcore_rl.run.plan_cli import add_assume_gpu

LAYER_SPECS = {"te": "te (TransformerEngine: fused norm + linear names, flash attention)",
               "local": "local (megatron's pure-PyTorch layers and names)"}
# "ipc": the engine's ranks share devices with actor ranks (CUDA IPC on GPU, shared memory on
# CPU); "p2p": sends and receives over the sync group.
TRANSPORTS = {"p2p": "p2p (sync group)", "ipc": "ipc (devices shared with actor ranks)"}
# rollout.expert_parallel (MoE models only: a dense model has no experts to place)
EXPERTS = {False: "split over TP (every engine rank holds a slice of every expert)",
           True: "expert parallel (each engine rank holds whole experts, vLLM's linear "
                 "placement)"}
# How Megatron runs a MoE layer's local experts: models.spec.grouped_expert_gemm(layer spec).
MEGATRON_EXPERTS = {True: "TEGroupedMLP (one grouped GEMM per linear over the rank's experts)",
                    False: "SequentialMLP (one MLP per local expert)"}
# vLLM sizes itself against the free memory it measures at start-up (ResolvedRun.trainers_first)
START_UP = {True: "trainers first, then the engines (devices shared)",
            False: "trainers and engines together"}


def engine_mode(cfg, run) -> str:
    """How the engines execute and sleep, as the plan resolved it."""
    if run.enforce_eager:
        mode = "eager (no CUDA graphs)"
    elif cfg.rollout.compile:
        mode = "torch.compile + CUDA graphs"
    else:
        mode = "CUDA graphs of decode steps, nothing compiled"
    if cfg.rollout.enable_sleep and run.device == "cuda":
        mode += (f" · sleep level {run.sleep_level} while training; wake weights, sync, "
                 "then the KV cache")
    return mode


def trainer_kernels(run) -> str:
    """What the trainers are asked to fuse, and how they overlap, as the plan resolved it
    (each rank turns on only the kernels its node provides: `kernel_decisions`)."""
    asked = [what for what, on in (
        ("TE fused RoPE + apex weight-grad accumulation", run.fused_kernels),
        ("SwiGLU + bias-dropout-add fused (torch.compile)", run.compiled_fusions)) if on]
    kernels = "asks for " + " · ".join(asked) if asked else "unfused"
    reduce = ("overlapped with the backward" if run.overlap_grad_reduce
              else "after the backward")
    return f"{kernels} · DP grad reduce {reduce}"


# where the fused kernels are decided (models.kernels): the driver cannot see the nodes
KERNELS_DECIDED = ("on each actor rank's node, before it builds its model; shown: this "
                   "machine's decisions")


def kernel_decisions(run):
    """Each fused kernel as a rank on this machine would turn it on (`models.kernels`)."""
    return resolve_kernels(run.fused_kernels, run.compiled_fusions, device=run.device)


def kernels_row(decisions) -> str:
    """The kernels the plan asks for, each on or off here and why (one line each)."""
    asked = [d for d in decisions if d.wanted]
    if not asked:
        return "none asked for"
    return "\n".join(f"{d.field} {d.reason}" for d in asked) + "\n(decided " \
        f"{KERNELS_DECIDED})"


# algorithm.routing_replay → what the actor's MoE passes route with
ROUTING_REPLAY = {
    "none": "none: every forward's routers choose its experts",
    "old": "old: the π_old pass records each token's experts; every update mini-batch "
           "replays them",
    "rollout": "rollout: the engines' experts, replayed in the π_old and update passes",
}


def lora_row(lora) -> str:
    """The actor's adapters, as `actor.lora` sets them, and how the engines get them."""
    engines = ("the adapters alone each sync (vLLM's LoRA)" if lora.syncs_adapters else
               "W + (alpha/rank)·B·A merged per shard")
    return (f"rank {lora.rank} · alpha {lora.alpha:g} · lr {lora.lr:g} on "
            f"{', '.join(lora.targets)} · base frozen, reference = base · engines get "
            f"{engines}")


def fp8_row(cfg, run, spec) -> str:
    """`rollout.quantization`: the scheme, one sync's bytes against the unquantized sync (from
    the real plan), who quantizes, and the rollout correction."""
    from mcore_rl.planning.sync_traffic import fp8_sync, sync_plan  # lazy: torch
    from mcore_rl.rollout.quantization import correction_advice  # lazy: torch

    fp8 = fp8_sync(cfg, run, spec, sync_plan(cfg, run, spec))
    gib = 1 << 30
    who = ("every FP8 region, after one all-reduce of each tensor's amax"
           if fp8["scheme"] == "fp8_per_tensor" else
           f"the tensors all of whose regions lie on the 128×128 block grid "
           f"({fp8['sender_share']:.0%} of the FP8 elements), the engine ranks the rest")
    return (f"{fp8['scheme']} · one sync {fp8['total_bytes'] / gib:.1f} GiB vs "
            f"{fp8['without_fp8_bytes'] / gib:.1f} GiB unquantized ({fp8['ratio']:.3f}×) · "
            f"the trainer ranks quantize {who}\n"
            f"{correction_advice(cfg.algorithm.rollout_correction.mode)}")


def megatron_experts(run) -> str:
    return MEGATRON_EXPERTS[grouped_expert_gemm(run.layer_spec)]


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
    p = sub.add_parser("explain", help="what a run config will run here: its shape, device, "
                                       "layer spec, sync backend and devices by role")
    p.add_argument("config", help="run config YAML (e.g. configs/gpu/llama3-70b.yaml)")
    p.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    add_assume_gpu(p)
    p.add_argument("--ranks", action="store_true",
                   help="also a row per engine and per actor rank")
    p.add_argument("--json", action="store_true",
                   help="print only one JSON object (the resolved run and one sync's bytes "
                        "per engine by transport) instead of the tables")
    p.set_defaults(func=run_explain)


def _where(slot, device: str) -> str:
    return f"node {slot.node} · {device}"


def _span(values: list[int]) -> str:
    """Sorted integers as ranges: [0, 1, 2, 3, 6] -> "0–3, 6"."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _grouped(slots) -> str:
    """Device slots grouped: nodes holding the same devices share one entry
    ("nodes 0–3: devices 0–7")."""
    by_node: dict[int, list[int]] = {}
    for slot in slots:
        by_node.setdefault(slot.node, []).append(slot.device)
    groups: dict[str, list[int]] = {}
    for node, devices in by_node.items():
        groups.setdefault(_span(devices), []).append(node)
    return "; ".join(f"{'nodes' if len(nodes) > 1 else 'node'} {_span(nodes)}: devices {devs}"
                     for devs, nodes in groups.items())


def _params(n: int) -> str:
    """A parameter count as people write it: 70.55 B, 0.5 M, 12 K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def shape_of(cfg, spec) -> list[tuple[str, str]]:
    """The run's shape: model, algorithm, batch and lengths."""
    kind = (f"MoE, {spec.num_experts} experts ({spec.experts_per_token} per token)"
            if spec.is_moe else "dense")
    algo = cfg.algorithm
    kl = f", KL {algo.kl_coeff:g} ({algo.kl_mode})" if algo.kl_coeff > 0 else ""
    return [
        ("model", f"{spec.family} · {_params(spec.num_params())} params · {kind} · "
                  f"{spec.layers} layers · vocab {spec.vocab}"),
        ("algorithm", f"{algo.advantage_estimator}{kl} · {cfg.steps} steps · "
                      f"rollout {cfg.rollout.mode}"),
        ("batch", f"{cfg.prompts_per_step} prompts × {cfg.samples_per_prompt} samples · "
                  f"{cfg.updates_per_batch} update(s) per batch"),
        ("lengths", f"prompt ≤ {cfg.max_prompt_tokens} · response ≤ {cfg.max_new_tokens} · "
                    f"train seq_len {cfg.train.seq_len}"),
    ]


def render(run, title: str, *, cfg, spec, ranks: bool = False):
    """The resolved run as rich renderables: one table of the run's shape, resolution and
    devices by role; with `ranks`, a row per engine and per actor rank too."""
    c, a = run.cluster, cfg.actor
    facts = Table(title=title, show_header=False, title_justify="left")
    facts.add_column("what", style="bold")
    facts.add_column("resolved")
    engines = run.placement.engines
    transports = sorted(set(run.transports))
    rows = [
        *shape_of(cfg, spec),
        ("device", run.device),
        ("layer spec", LAYER_SPECS[run.layer_spec]),
        ("sync backend", run.sync_backend),
        ("placement", f"{run.placement.placement}: {run.placement.nodes} node(s) × "
                      f"{run.placement.devices_per_node} devices"),
        ("allocation", f"{c.nodes} × {c.gpus_per_node} {c.device}, {c.device_gib:g} GiB "
                       f"each ({c.reserve_gib:g} reserved)"),
        ("dtypes", f"actor params {run.param_dtype} · engines {run.rollout_dtype} · "
                   f"weight sync {run.wire_dtype}"),
        ("sync buckets", f"{run.sync_bucket_mb:g} MB"),
        ("engines run", engine_mode(cfg, run)),
        ("trainers run", trainer_kernels(run)),
        ("kernels", kernels_row(kernel_decisions(run))),
        *([("LoRA", lora_row(cfg.actor.lora))] if cfg.actor.lora.enabled else []),
        *([("FP8 rollouts", fp8_row(cfg, run, spec))] if cfg.rollout.quantization else []),
        ("start-up", START_UP[run.trainers_first]),
        *([("after update", "the trainers give their cached activation peak back to the "
                               "GPU (the engines' KV cache wakes into it)")]
          if run.release_trainer_cache else []),
        ("roles", hosted_roles(cfg)),
        *([("Megatron experts", megatron_experts(run)),
           ("vLLM experts", EXPERTS[run.expert_parallel]),
           ("routing replay", ROUTING_REPLAY[cfg.algorithm.routing_replay])]
          if spec.is_moe else []),
        ("actor ranks", f"{a.world_size} (tp {a.tp} · pp {a.pp} · dp {a.dp}"
                        f"{f' · ep {a.ep}' if a.ep > 1 else ''}) · "
                        f"{_grouped(run.placement.actor)}"),
        ("engines", f"{len(engines)} × tp {cfg.rollout.tp} · "
                    f"{', '.join(TRANSPORTS[t] for t in transports)} · "
                    f"{_grouped([s for e in engines for s in e])}"),
    ]
    for what, value in rows:
        facts.add_row(what, value)
    if not ranks:
        return (facts,)
    per_engine = Table(title="engines", title_justify="left")
    for name in ("engine", "tp", "transport", "devices (tp rank order)"):
        per_engine.add_column(name)
    for e, (slots, devices) in enumerate(zip(engines, run.engine_devices)):
        per_engine.add_row(str(e), str(len(slots)), TRANSPORTS[run.transports[e]],
                           ", ".join(_where(s, d) for s, d in zip(slots, devices)))
    actor = Table(title="actor ranks", title_justify="left")
    for name in ("rank", "device"):
        actor.add_column(name)
    for r, (slot, device) in enumerate(zip(run.placement.actor, run.actor_devices)):
        actor.add_row(str(r), _where(slot, device))
    return facts, per_engine, actor


def run_explain(args) -> int:
    """Exit 0 with the resolved run; 2 when the config does not load, fails a grid check
    or cannot be placed."""
    from mcore_rl.planning.grid_checks import GRID_CHECKS, preflight  # lazy: torch
    from mcore_rl.planning.sized import sized_run  # lazy: torch
    from mcore_rl.runconfig import RLConfig  # lazy: torch
    from mcore_rl.runconfig.resolve import resolve_run  # lazy: torch

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
    if args.json:
        from mcore_rl.planning.sync_traffic import explain_traffic  # lazy: torch

        # one sync's bytes per engine by transport, from the real plan (IPC never crosses a
        # node)
        experts = ({"megatron_experts": megatron_experts(run).split(" ", 1)[0]}
                   if sized.spec.is_moe else {})
        # each fused kernel as this machine decides it (each actor rank decides on its node)
        kernels = {"kernels": {d.field: {k: v for k, v in d.as_dict().items() if k != "field"}
                               for d in kernel_decisions(run)},
                   "kernels_decided": KERNELS_DECIDED}
        print(json.dumps({**run.summary(), **experts, **kernels, **explain_traffic(cfg, run)},
                         separators=(",", ":")))
        return 0
    how = " (GPU assumed)" if args.assume_gpu else ""
    console = Console(width=120, soft_wrap=False)
    for table in render(run, f"{args.config}{how}: what will run", cfg=cfg, spec=sized.spec,
                        ranks=args.ranks):
        console.print(table)
    return 0


__all__ = ["add_parser", "render", "run_explain"]
