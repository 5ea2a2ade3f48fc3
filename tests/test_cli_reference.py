"""docs/reference/cli.md is every command's `--help`, generated from the parser
(scripts/gen_cli_reference.py), and must not drift from it: a new command, option or help text
changes the page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_reference",
                                                  ROOT / "scripts" / "gen_cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_cli_reference_is_current(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert page == _generator().render(), (
        "docs/reference/cli.md is out of date with the parser: regenerate it with "
        "`.venv/bin/python scripts/gen_cli_reference.py`")


def test_every_listed_command_has_a_section(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    from mcore_rl.cli import build_parser

    gen = _generator()
    page = gen.render()
    for name, sub in gen._subcommands(build_parser()).items():
        nested = gen._subcommands(sub) or {"": None}
        for kind in nested:
            assert f"## mcore-rl {name} {kind}".rstrip() + "\n" in page, (name, kind)
