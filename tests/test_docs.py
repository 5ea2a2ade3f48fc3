"""The docs as a site would build them (what `mkdocs build --strict` refuses, checked without
mkdocs): every page is in mkdocs.yml's nav and every nav entry is a page; every relative link in
README.md and docs/ reaches a file; every `mcore-rl COMMAND` they show is a real command and
every configs/*.yaml they name exists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
READ = [ROOT / "README.md", *PAGES]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _nav_pages(entries) -> list[str]:
    out = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == sorted(str(p.relative_to(DOCS)) for p in PAGES)


def test_relative_links_reach_a_file():
    broken = []
    for page in READ:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = target.split("#")[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_commands_and_configs_shown_exist():
    from mcore_rl.cli import COMMANDS

    unknown, missing = [], []
    for page in READ:
        text = page.read_text()
        # as typed: at a line's start, after a backtick or a venv's bin/ (not prose)
        for command in re.findall(r"(?:^|`|bin/)mcore-rl ([a-z][a-z-]*)", text, re.M):
            if command not in COMMANDS:
                unknown.append(f"{page.relative_to(ROOT)}: mcore-rl {command}")
        for config in re.findall(r"\bconfigs/[\w./-]+\.yaml", text):
            if not (ROOT / config).is_file():
                missing.append(f"{page.relative_to(ROOT)}: {config}")
    assert not unknown, unknown
    assert not missing, missing
