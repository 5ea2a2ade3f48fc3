"""The architecture holds: packages in layers (`.importlinter`, docs/design/architecture.md),
each importing only from the layers below, function-level imports included; no module imports
itself back through others."""

from __future__ import annotations

import pytest

import os
from pathlib import Path
from typing import TYPE_CHECKING

# grimp and import-linter (the `test` extra) are imported by the tests that use them: a machine
# without them (the GPU check machine: scripts/gpu_check.sh) still collects this module.
if TYPE_CHECKING:
    import grimp

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contract_is_kept(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    from importlinter.cli import lint_imports

    code = lint_imports(config_filename=str(ROOT / ".importlinter"), no_cache=True,
                        no_logo=True)
    assert code == 0, capsys.readouterr().out[-4000:]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan, iterative)."""
    imports = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(imports[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(imports[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_import_cycles():
    import grimp

    graph = grimp.build_graph("mcore_rl", exclude_type_checking_imports=False, cache_dir=None)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: a two-module cycle (one import inside a function) is found."""
    package = tmp_path / "cyclic_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic_pkg import b\n")
    (package / "b.py").write_text("def f():\n    from cyclic_pkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert os.path.isdir(package)
    import grimp

    graph = grimp.build_graph("cyclic_pkg", cache_dir=None)
    assert _cycles(graph) == [["cyclic_pkg.a", "cyclic_pkg.b"]]
