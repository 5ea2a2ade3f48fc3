"""The architecture holds: packages in layers (`.importlinter`, docs/design/architecture.md),
each importing only from the layers below, function-level imports included; no module imports
itself back through others."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

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


# --- imports by rule: test_every_function_level_import_defers_a_heavy_library ---------------
# The libraries a lazy import may defer: slow to import (`python -X importtime -c "import X"`:
# on the order of a second or more, or a large share of the CLI's start-up) or optional (an
# extra, built by hand, or absent on the GPU check machine: scripts/gpu_check.sh). Light ones
# (numpy, tqdm, psutil, yaml, sentencepiece, tokenizers, rich, safetensors) go at the top.
HEAVY = {
    "megatron": "slow (megatron.core, torch included)",
    "peft": "slow (torch and transformers included)",
    "vllm": "slow; the `cpu`/`gpu` extras, not on the GPU check machine",
    "torch": "slow",
    # a part of a library as heavy as a library: a lazy import of it is marked with its name
    "torch.distributed.checkpoint": "slow beyond torch itself (it loads sympy)",
    "transformers": "slow; its model, config and tokenizer classes load torch",
    "datasets": "slow",
    "wandb": "slow; the `wandb` extra",
    "matplotlib": "slow with pyplot",
    "ray": "not on the GPU check machine",
    "tensorboard": "torch.utils.tensorboard: slow beyond torch itself",
    "trl": "the `bench` extra; its GRPOTrainer loads vLLM, Ray, peft and datasets",
    "transformer_engine": "the `gpu` extra",
    "apex": "built by hand (docs/getting-started/install.md)",
    "fused_weight_gradient_mlp_cuda": "apex's CUDA extension",
}
# what importing a library, or one of its modules, loads of the others (sys.modules after it)
LOADS = {
    "megatron": {"torch"}, "vllm": {"torch"}, "peft": {"torch", "transformers"},
    "transformers": {"torch"}, "trl": {"torch", "transformers"}, "transformer_engine": {"torch"},
    "apex": {"torch"}, "fused_weight_gradient_mlp_cuda": {"torch"},
    "safetensors.torch": {"torch"}, "torch.utils.tensorboard": {"tensorboard"},
}
_MARK = re.compile(r"#\s*lazy:\s*([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)")
_Import = ast.Import | ast.ImportFrom
_BLOCKS = ("body", "orelse", "finalbody")


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _split_imports(tree: ast.Module) -> tuple[list[_Import], list[_Import]]:
    """(module-level imports, function-level ones), those under `if TYPE_CHECKING:` left out."""
    module_level: list[_Import] = []
    function_level: list[_Import] = []

    def visit(statements: list[ast.stmt], in_function: bool) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (function_level if in_function else module_level).append(node)
                continue
            inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            # an import is a statement: only the blocks of statements can hold one
            for block in ("orelse",) if _is_type_checking(node) else _BLOCKS:
                visit(getattr(node, block, ()), inside)
            for clause in [*getattr(node, "handlers", ()), *getattr(node, "cases", ())]:
                visit(clause.body, inside)

    visit(tree.body, False)
    return module_level, function_level


class _ImportClosures:
    """What each first-party module loads at import time: its module-level imports, followed
    through first-party modules (and their packages' `__init__`s), as third-party top-level
    package names."""

    def __init__(self, root: Path, first_party: tuple[str, ...]):
        self.root, self.first_party = root, first_party
        self.files: dict[str, Path] = {}
        for package in first_party:
            for path in sorted((root / package).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                self.files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.trees = {name: ast.parse(path.read_text(), str(path))
                      for name, path in self.files.items()}
        self.imports = {name: _split_imports(tree) for name, tree in self.trees.items()}
        self._closures: dict[str, frozenset[str]] = {}

    def targets(self, node: _Import, module: str) -> list[str]:
        """The dotted names `node` imports (`from a import b`: `a.b`, a module or a name)."""
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            is_package = self.files[module].name == "__init__.py"
            package = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        return [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]

    def libraries(self, dotted: str) -> frozenset[str]:
        """The third-party packages (and heavy parts of them: `HEAVY`) importing `dotted`
        loads."""
        top = dotted.partition(".")[0]
        if top in self.first_party:
            parts = dotted.split(".")
            found: set[str] = set()
            for i in range(1, len(parts) + 1):
                if ".".join(parts[:i]) in self.files:
                    found |= self.closure(".".join(parts[:i]))
            return frozenset(found)
        if top in sys.stdlib_module_names:
            return frozenset()
        parts = dotted.split(".")
        found = {top}
        for prefix in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
            found |= LOADS.get(prefix, set()) | ({prefix} & HEAVY.keys())
        return frozenset(found)

    def closure(self, module: str) -> frozenset[str]:
        """The third-party packages importing first-party `module` loads."""
        if module not in self._closures:
            self._closures[module] = frozenset()  # a module-level cycle ends here
            found: set[str] = set()
            parent = module.rpartition(".")[0]
            if parent in self.files:
                found |= self.closure(parent)
            for node in self.imports[module][0]:
                for dotted in self.targets(node, module):
                    found |= self.libraries(dotted)
            self._closures[module] = frozenset(found)
        return self._closures[module]


def _marked(lines: list[str], node: _Import) -> list[str] | None:
    """The libraries named by `# lazy: LIB[, LIB]` on the import's lines or the line above."""
    for line in lines[node.lineno - 1:node.end_lineno]:
        if match := _MARK.search(line):
            return [name.strip() for name in match.group(1).split(",")]
    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
    if above.startswith("#") and (match := _MARK.match(above)):
        return [name.strip() for name in match.group(1).split(",")]
    return None


def lazy_import_problems(root: Path, package: str,
                         first_party: tuple[str, ...] = ()) -> list[str]:
    """`path:line: import — why` for each function-level import in `package` (under `root`)
    that breaks the rule (the docstring above)."""
    closures = _ImportClosures(root, (package, *first_party))
    problems = []
    for module, path in closures.files.items():
        if module.partition(".")[0] != package:
            continue
        lines = path.read_text().splitlines()
        module_level, function_level = closures.imports[module]
        at_top = {ast.unparse(node) for node in module_level}
        loaded = closures.closure(module)
        for node in function_level:
            target: set[str] = set()
            for dotted in closures.targets(node, module):
                target |= closures.libraries(dotted)
            deferred = sorted((target - loaded) & HEAVY.keys(),
                              key=list(HEAVY).index)
            marks = _marked(lines, node)
            if marks is None:
                if deferred:
                    why = f"not marked: mark it `# lazy: {deferred[0]}`"
                elif ast.unparse(node) in at_top:
                    why = "the module imports it at its top already: remove it"
                else:
                    why = ("defers no heavy library the module does not load already: import "
                           "it at the module's top")
            else:
                wrong = [f"`{lib}` is not a heavy library (HEAVY)" for lib in marks
                         if lib not in HEAVY]
                wrong += [f"it does not load {lib}" for lib in marks
                          if lib in HEAVY and lib not in target]
                wrong += [f"the module loads {lib} at import time already" for lib in marks
                          if lib in HEAVY and lib in loaded]
                if not wrong:
                    continue
                why = "; ".join(wrong) + (
                    f" (it defers {', '.join(deferred)})" if deferred
                    else ": import it at the module's top")
            problems.append(f"{path.relative_to(root)}:{node.lineno}: "
                            f"{' '.join(ast.unparse(node).split())} — {why}")
    return problems


def test_every_function_level_import_defers_a_heavy_library():
    """A function-level import (lazy import) is allowed only where it defers loading a heavy or
    optional library (`HEAVY`) that the importing module does not already load at import time.
    An import of an mcore_rl module defers what that module loads at import time, transitively
    (its module-level imports and its packages' `__init__`s, `if TYPE_CHECKING:` blocks left
    out), less what the importing module loads itself. Each one is marked with the library it
    defers, `# lazy: LIB` at the end of the import's line or alone on the line just above it.
    Every other import (the standard library, light third-party libraries, mcore_rl modules that
    load nothing heavy the importer does not already load) sits at the top of its module."""
    problems = lazy_import_problems(ROOT, "mcore_rl", first_party=("tools",))
    assert not problems, "\n".join(problems)


def test_the_lazy_import_check_finds_what_breaks_the_rule(tmp_path):
    """The check above can fail: unmarked, needless and wrongly marked lazy imports are found;
    marked ones that defer a heavy library are not."""
    package = tmp_path / "lazy_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "heavy.py").write_text("import json\n\nimport torch\n")
    (package / "light.py").write_text("from . import util\n")
    (package / "util.py").write_text("import os\n")
    (package / "uses_torch.py").write_text(
        "from typing import TYPE_CHECKING\n\nimport torch\n\n"
        "if TYPE_CHECKING:\n    import vllm\n\n\n"
        "def a():\n    import json\n\n\n"                           # 10: stdlib
        "def b():\n    from lazy_pkg import heavy  # lazy: torch\n\n\n"  # 14: loads torch already
        "def c():\n    import torch\n\n\n"                          # 18: duplicate
        "def d():\n    import vllm  # lazy: vllm\n\n\n"              # 22: fine
        "def e():\n    import torch.distributed.checkpoint  # lazy: torch.distributed.checkpoint\n")
    (package / "no_torch.py").write_text(
        "def a():\n    from lazy_pkg import heavy  # lazy: torch\n\n\n"  # 2: fine
        "def b():\n    # lazy: torch\n    from lazy_pkg.heavy import json\n\n\n"  # 7: fine
        "def c():\n    from lazy_pkg import light  # lazy: torch\n\n\n"  # 11: defers nothing
        "def d():\n    from .heavy import torch\n\n\n"              # 15: not marked
        "def e():\n    import vllm  # lazy: vllm, numpy\n")           # 19: numpy is light
    problems = lazy_import_problems(tmp_path, "lazy_pkg")
    assert [p.split(" — ")[0] for p in problems] == [
        "lazy_pkg/no_torch.py:11: from lazy_pkg import light",
        "lazy_pkg/no_torch.py:15: from .heavy import torch",
        "lazy_pkg/no_torch.py:19: import vllm",
        "lazy_pkg/uses_torch.py:10: import json",
        "lazy_pkg/uses_torch.py:14: from lazy_pkg import heavy",
        "lazy_pkg/uses_torch.py:18: import torch",
    ], problems
    assert "does not load torch" in problems[0]
    assert "mark it `# lazy: torch`" in problems[1]
    assert "`numpy` is not a heavy library" in problems[2]
    assert "import it at the module's top" in problems[3]
    assert "loads torch at import time already" in problems[4]
    assert "imports it at its top already" in problems[5]
