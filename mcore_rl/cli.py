"""`mcore-rl` console script. Each subcommand lives with the package it drives; this file only
lists them. A subcommand module exposes `add_parser(subparsers)` which registers itself and
sets `func` (called with the parsed args, returning an exit code).

`demo`, `train` and `bench <kind>` take their config as `--config FILE` or as the first
positional argument (`mcore-rl train configs/grpo_addition.yaml a.b=c`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

from mcore_rl.launch.exit_codes import INTERRUPT_EXIT_CODE
from mcore_rl.launch.startup_gc import gc_paused

# name → module providing add_parser(). Add a row when a command becomes real.
COMMANDS: dict[str, str] = {
    "bench": "mcore_rl.bench.cli",
    "convert": "tools.checkpoint_convert.cli",
    "explain": "mcore_rl.run.explain",
    "export": "mcore_rl.run.export",
    "plan-memory": "mcore_rl.run.plan_cli",
    "preflight": "mcore_rl.run.plan_cli",
    "ray-run": "mcore_rl.launch.ray_cluster",
    "demo": "mcore_rl.run.train",
    "plot": "mcore_rl.run.train",
    "train": "mcore_rl.run.train",
    "train-lm": "mcore_rl.train_lm",
}


def _bind_localhost_by_default() -> None:
    """Ray (imported by vLLM too) listens on the machine's address unless this is set before
    its first import; our ports bind to localhost unless the user configures otherwise."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


DESCRIPTION = ("RL post-training (PPO, GRPO) with Megatron-Core actors and vLLM engines. "
               "`mcore-rl COMMAND --help` gives a command's options; docs/reference/cli.md "
               "lists them all.")

# commands whose config may be given positionally, before the a.b=c overrides
POSITIONAL_CONFIG = ("demo", "train", "bench")


def version() -> str:
    """The installed distribution's version (the source tree's setup.cfg one when not
    installed)."""
    try:
        return dist_version("mcore-rl")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-rl", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"mcore-rl {version()}")
    # `ray-run` runs another mcore-rl command in this process: it is handed this entry point
    parser.set_defaults(cli_main=main)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in dict.fromkeys(COMMANDS.values()):
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a Ctrl-C that the command does not handle itself (train and demo stop
    at the next step with a checkpoint, convert removes its partial output) is one line and
    exit 130 (128 + SIGINT), not a traceback."""
    _bind_localhost_by_default()
    try:
        with gc_paused():  # the commands' imports (mcore_rl/launch/startup_gc.py)
            parser = build_parser()
        args = _parse(parser, argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"mcore-rl: interrupted (Ctrl-C); exit code {INTERRUPT_EXIT_CODE}",
              file=sys.stderr, flush=True)
        return INTERRUPT_EXIT_CODE


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Like `parse_args`, but `a.b=c` overrides may also follow options
    (`bench sync actor.tp=2 --out x rollout.tp=2`); argparse alone stops at the first option."""
    args, extra = parser.parse_known_args(argv)
    dashed = _dashed_overrides(extra) if hasattr(args, "overrides") else {}
    if dashed:  # `--actor.tp=2` or `--actor.tp 2`: an override written as an option
        parser.exit(2, f"mcore-rl {args.command}: {' '.join(dashed)}: overrides are written "
                       f"{' '.join(dashed.values())} (no dashes)\n")
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    _positional_config(parser, args)
    return args


def _dashed_overrides(extra: list[str]) -> dict[str, str]:
    """The unknown options of `extra` that are overrides written as options, each as given
    → as an override: `--actor.tp=2` and `--actor.tp 2` → `actor.tp=2`, `--steps=3` →
    `steps=3` (a dotted key, or a key with `=value`; another unknown option is argparse's)."""
    found, rest = {}, list(extra)
    while rest:
        item = rest.pop(0)
        key, sep, value = item.lstrip("-").partition("=")
        if not item.startswith("-") or not key or not key.replace(".", "_").isidentifier():
            continue
        if sep:
            found[item] = f"{key}={value}"
        elif "." in key and rest and not rest[0].startswith("-") and "=" not in rest[0]:
            value = rest.pop(0)
            found[f"{item} {value}"] = f"{key}={value}"
    return found


def _positional_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`mcore-rl train CONFIG [a.b=c ...]`: a first positional argument that is not an
    `a.b=c` override is the config (as `--config CONFIG`); `train` needs one of the two."""
    if args.command not in POSITIONAL_CONFIG or not hasattr(args, "config"):
        return
    overrides = list(getattr(args, "overrides", None) or [])
    if overrides and "=" not in overrides[0]:
        if args.config is not None:
            parser.error(f"{args.command}: the config is given twice: --config {args.config} "
                         f"and {overrides[0]}")
        # demo and train take a Path, bench its FILE string: keep each command's type
        args.config = overrides[0] if args.command == "bench" else Path(overrides[0])
        args.overrides = overrides[1:]
    if args.command == "train" and args.config is None:
        parser.error("train: a config is required: mcore-rl train CONFIG [a.b=c ...] "
                     "(or --config CONFIG)")


if __name__ == "__main__":
    sys.exit(main())
