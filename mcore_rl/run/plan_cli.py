"""`mcore-rl plan-memory CONFIG` and `mcore-rl preflight CONFIG`: both read the run's config
(an `RLConfig` YAML, the file `mcore-rl train --config` reads, plus `a.b.c=value` overrides)
and need no GPU, no weights and no megatron import: the cluster section says what to size
for, `model.preset` stands in for a checkpoint that is not on this machine, and
`--assume-gpu` sizes a "local" cluster as a GPU machine even on a CPU-only one. Preflight
reads the files the run reads (model.hf_dir, task.path, ...) and refuses a path that is not
here, unless `--remote-paths` says the config is checked away from them.

A config that cannot be read (no such file, a YAML syntax error) is one line on stderr,
`file:line:col: problem`, and exit `CONFIG_ERROR_EXIT` (2), as in every command. A preflight
that finds an error exits 2 too: it is a config problem, the one `train` refuses with the same
code; plan-memory exits 1 for a run that does not fit (its answer, not a config error)."""

from __future__ import annotations

import argparse
import json
import sys

from mcore_rl.config import CONFIG_ERROR_EXIT, ConfigError, ConfigFileError, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan-memory", help="per-device memory of an RL run, before launch")
    plan.add_argument("config", help="run config YAML (e.g. configs/gpu/llama3-70b.yaml)")
    plan.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    plan.add_argument("--device-gib", type=float, default=None,
                      help="memory per device (sets cluster.device_gib)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_assume_gpu(plan)
    plan.set_defaults(func=run_plan_memory)

    pre = sub.add_parser("preflight", help="check an RL run's config; lists every problem",
                         description="Check an RL run's config against the model, the devices "
                                     "and its files, and list every problem at once. Exit 0: "
                                     "no error (warnings allowed); 2: errors (the code train "
                                     "refuses them with, as every config problem).")
    pre.add_argument("config", help="run config YAML (e.g. configs/gpu/llama3-70b.yaml)")
    pre.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    pre.add_argument("--device-gib", type=float, default=None,
                     help="memory per device (sets cluster.device_gib)")
    pre.add_argument("--remote-paths", action="store_true",
                     help="the run's files (model.hf_dir, task.path, ...) are on another "
                          "machine: one not here is a warning, not an error")
    add_assume_gpu(pre)
    pre.set_defaults(func=run_preflight)


def add_assume_gpu(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--assume-gpu", action="store_true",
                        help="resolve the run as on a CUDA machine (TE layer spec, nccl) even "
                             "where there is none")


def _overrides(args) -> list[str]:
    extra = [f"cluster.device_gib={args.device_gib}"] if args.device_gib is not None else []
    return list(args.overrides) + extra


def run_plan_memory(args) -> int:
    """Exit 0 if the run fits, 1 if it does not, 2 if the config is invalid."""
    from mcore_rl.planning.knobs import plan_with_suggestions  # lazy: torch
    from mcore_rl.planning.report import format_plan, plan_to_json  # lazy: torch
    from mcore_rl.planning.sized import sized_run  # lazy: torch
    from mcore_rl.runconfig import RLConfig  # lazy: torch

    try:
        cfg = load_config(RLConfig, args.config, _overrides(args))
        plan = plan_with_suggestions(sized_run(cfg, assume_gpu=args.assume_gpu))
    except (ConfigError, ValueError) as err:
        print(f"mcore-rl plan-memory: config error: {err}", file=sys.stderr)
        if not isinstance(err, ConfigFileError):  # a file that is YAML: it may have more
            print("(run `mcore-rl preflight` for every problem of the config)",
                  file=sys.stderr)
        return CONFIG_ERROR_EXIT
    print(json.dumps(plan_to_json(plan), indent=1) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def run_preflight(args) -> int:
    """Exit 0 when there is no error (warnings allowed); CONFIG_ERROR_EXIT (2) when there is
    one, or the config file cannot be read."""
    from mcore_rl.planning.grid_checks import format_problems  # lazy: torch
    from mcore_rl.run.preflight import preflight_config  # lazy: torch

    try:
        _, problems = preflight_config(args.config, _overrides(args),
                                       assume_gpu=args.assume_gpu,
                                       remote_paths=args.remote_paths)
    except ConfigFileError as err:
        print(f"mcore-rl preflight: config error: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    print(f"preflight {args.config}: " + format_problems(problems))
    return CONFIG_ERROR_EXIT if any(p.severity == "error" for p in problems) else 0
