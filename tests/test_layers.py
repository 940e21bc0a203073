"""The layers of docs/architecture.md hold: imports run downward only, with no cycle, counting imports inside
functions; each import of voxdiff inside a function says why it is deferred; import-linter's contracts
(``[tool.importlinter]`` in pyproject.toml) are kept."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PACKAGE = "voxdiff"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (annotations only: never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skip


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules of the package an import statement runs: ``from a.b import c`` is ``a.b``, or ``a.b.c`` when
    that is a module; a relative import is resolved against ``module``."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".")
            if MODULES[module].name != "__init__.py":
                here = here[:-1]
            here = here[: len(here) - (node.level - 1)]
            base = ".".join([*here, base] if base else here)
        names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    out = set()
    for name in names:
        while name and name not in MODULES:  # a name inside a module: the module
            name = name.rpartition(".")[0]
        if name and name != PACKAGE and name != module and not module.startswith(name + "."):
            out.add(name)
    return out


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, ast.stmt, list[ast.stmt], list[str]]]]:
    """The import graph (every import statement, those inside functions too, TYPE_CHECKING blocks left out), and
    the imports of the package inside functions: (module, statement, its run of import statements, source lines)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    deferred, seen = [], set()
    for module, path in MODULES.items():
        text = path.read_text()
        tree = ast.parse(text)
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                edges[module] |= _imported(module, node)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for block in ast.walk(fn):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    stmts = getattr(block, field, None)
                    if not isinstance(stmts, list):
                        continue
                    run: list[ast.stmt] = []
                    for stmt in [*stmts, None]:
                        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                            run.append(stmt)
                            continue
                        for imp in run:
                            if id(imp) not in skip and id(imp) not in seen and _imported(module, imp):
                                seen.add(id(imp))
                                deferred.append((module, imp, list(run), text.splitlines()))
                        run = []
    return edges, deferred


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
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


def test_no_import_cycle_counting_imports_inside_functions():
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_import_inside_a_function_says_why_it_is_deferred():
    """A ``# deferred: <why>`` comment on the import, or on the lines of the run of imports it belongs to (or
    the line above that run). Anything else belongs at the top of its module."""
    _, deferred = _graph()
    missing = []
    for module, node, run, lines in deferred:
        first, last = run[0].lineno - 1, run[-1].end_lineno
        if not any("# deferred:" in line for line in lines[first - 1:last]):
            missing.append(f"{MODULES[module].relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not missing, "imports inside functions without a '# deferred: why' comment:\n" + "\n".join(missing)


def test_the_import_contracts_are_kept():
    """``lint-imports`` (import-linter, in the ``test`` extra) on the contracts of pyproject.toml: the layers, the
    preflight's tiers, and Lightning kept out of the preflight and the layers below the systems."""
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.exists() or shutil.which("lint-imports"), "import-linter is missing: pip install -e .[test]"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([str(exe) if exe.exists() else "lint-imports", "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
