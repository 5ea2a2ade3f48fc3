"""Tools keep the style of the pure layers — the packages that compute configs, layouts,
plans and losses without starting a process: ruff's lint (pyflakes, pycodestyle, bugbear,
pyupgrade) and import order, ruff's formatter, and mypy's types (pyproject.toml holds each
tool's settings). Run them by hand with the commands in the assertion messages."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# linted and formatted
PURE = ["mcore_rl/config", "mcore_rl/parallel", "mcore_rl/algorithms", "mcore_rl/layouts",
        "mcore_rl/runconfig", "mcore_rl/planning", "mcore_rl/resharding/planner.py",
        "mcore_rl/resharding/fp8.py"]
# type-checked: every pure layer ("null = derived" fields are typed as the value they hold
# once derived: mcore_rl/config/derived.py)
TYPED = PURE


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_ruff_lint_and_import_order_are_clean():
    proc = _run("ruff", "check", "--no-cache", *PURE)
    assert proc.returncode == 0, f"`.venv/bin/ruff check --fix {' '.join(PURE)}`:\n" + \
        proc.stdout[-4000:]


def test_ruff_format_is_applied():
    proc = _run("ruff", "format", "--check", "--no-cache", *PURE)
    assert proc.returncode == 0, f"`.venv/bin/ruff format {' '.join(PURE)}`:\n" + \
        proc.stdout[-4000:]


def test_mypy_finds_no_type_error():
    proc = _run("mypy", "--no-incremental", *TYPED)
    assert proc.returncode == 0, f"`.venv/bin/mypy {' '.join(TYPED)}`:\n" + proc.stdout[-4000:]


MAX_FUNCTION_LINES = 60  # STYLE.md: small functions


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of `node`'s body that hold code: not its docstring, a comment or a blank line."""
    first = node.body[0]
    start = first.lineno
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        start = first.end_lineno + 1
    return sum(1 for line in lines[start - 1:node.end_lineno]
               if line.strip() and not line.strip().startswith("#"))


def test_no_function_is_longer_than_the_style_allows():
    """Every function in mcore_rl has at most MAX_FUNCTION_LINES lines of code (a nested
    function counts within its parent too): a longer one is split into named steps."""
    long = []
    for path in sorted((ROOT / "mcore_rl").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, lines)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "functions over the style's length:\n" + "\n".join(long)


def test_the_length_count_leaves_out_docstrings_comments_and_blank_lines():
    source = 'def f():\n    """doc\n    more"""\n    # why\n\n    x = 1\n    return x\n'
    assert _code_lines(ast.parse(source).body[0], source.splitlines()) == 2


# a repository path as code and docs name one: mcore_rl/..., tests/..., docs/...
_REPO_PATH = re.compile(r"(?<![\w/.-])((?:mcore_rl|tests|scripts|docs|configs|tools)/[\w./-]*?"
                        r"\w\.(?:py|md|yaml|yml|sh|jsonl|json|toml|txt))(?![\w-])")
_NAMED_IN = ("mcore_rl", "scripts", "docs", "configs", "tools", ".ci")


def _repository_references() -> list[tuple[str, int, str]]:
    files = [p for d in _NAMED_IN for p in (ROOT / d).rglob("*") if p.is_file()
             and p.suffix in (".py", ".md", ".yaml", ".sh", "")] + [ROOT / "README.md"]
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            found += [(str(path.relative_to(ROOT)), number, m.group(1))
                      for m in _REPO_PATH.finditer(line)]
    return found


def test_every_repository_path_the_code_and_docs_name_exists():
    """A path the code, scripts, configs and docs name inside the repository exists, and none
    points outside it (a sibling checkout, a machine's own directory): a reader can follow
    every reference from the checkout alone."""
    references = _repository_references()
    assert len(references) > 100  # the pattern finds the references there are
    missing = [f"{where}:{n}: {ref}" for where, n, ref in references if not (ROOT / ref).exists()]
    assert not missing, "\n".join(missing)
    outside = [f"{p.relative_to(ROOT)}" for d in _NAMED_IN for p in (ROOT / d).rglob("*.py")
               if "../shared" in p.read_text() or "/work/" in p.read_text()]
    assert not outside, outside
