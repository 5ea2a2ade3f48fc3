"""Write docs/reference/cli.md from the `mcore-rl` parser: every command's `--help`.

    .venv/bin/python scripts/gen_cli_reference.py          # rewrite the file
    .venv/bin/python scripts/gen_cli_reference.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TARGET = Path(__file__).resolve().parent.parent / "docs" / "reference" / "cli.md"
WIDTH = "80"  # argparse wraps help to $COLUMNS: fixed, so the page does not depend on a terminal

HEADER = """\
# CLI reference

Every command of `mcore-rl`, with its `--help` (`mcore-rl --version` prints the version).
`demo`, `train` and `bench <kind>` take their config as `--config FILE` or as the first
positional argument (`mcore-rl train configs/grpo_jsonl.yaml steps=50`). Each command that
takes a config also takes `a.b.c=value` overrides of any key ([config reference](config.md));
a config error exits 2 with one line naming the key (a YAML syntax error as `file:line:col`).
Exit codes: [troubleshooting](../guides/troubleshooting.md).
"""

# the order a user meets them: run, check, inspect, then the tools
ORDER = ("demo", "train", "preflight", "explain", "plan-memory", "plot", "export", "train-lm",
         "convert",
         "bench", "ray-run")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The listed subcommands of `parser` (those with help; hidden ones are left out)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {a.dest for a in action._choices_actions}
            return {name: p for name, p in action.choices.items() if name in listed}
    return {}


def _sections(prefix: str, parser: argparse.ArgumentParser):
    nested = _subcommands(parser)
    if not nested:
        yield prefix, parser.format_help()
        return
    for name, sub in nested.items():
        yield from _sections(f"{prefix} {name}", sub)


def render() -> str:
    os.environ["COLUMNS"] = WIDTH
    from mcore_rl.cli import build_parser

    parser = build_parser()
    commands = _subcommands(parser)
    missing = set(commands) - set(ORDER)
    if missing:
        raise SystemExit(f"scripts/gen_cli_reference.py: add {sorted(missing)} to ORDER")
    parts = [HEADER, f"## mcore-rl\n\n```\n{parser.format_help().rstrip()}\n```\n"]
    for name in ORDER:
        for title, text in _sections(f"mcore-rl {name}", commands[name]):
            parts.append(f"## {title}\n\n```\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    from generated_page import write_or_check

    return write_or_check(TARGET, render, argv, "gen_cli_reference.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
