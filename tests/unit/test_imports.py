"""The package's import graph: no circles, and what imports cheaply stays cheap.

Two graphs over the modules of async_rl, read from their source (nothing is imported):
- at import time: the imports a module runs when it is loaded (module level, outside
  `if TYPE_CHECKING:`), plus the package `__init__` that Python runs before any module
  of that package (a package importing its own modules is the usual re-export, not a
  circle). A circle here is an ImportError waiting for the right import order.
- by design: every import, also inside functions and under TYPE_CHECKING. A circle
  here means two modules each need the other, so neither is the lower layer.
Both must be free of circles.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "async_rl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, here: str) -> set[str]:
    """The async_rl modules an import statement loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = here if MODULES[here].name == "__init__.py" else here.rpartition(".")[0]
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return {name for name in names if name in MODULES}


def imports(name: str, at_import_time: bool) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    found: set[str] = set()

    def visit(nodes, top: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if top or not at_import_time:
                    found.update(_targets(node, name))
            elif isinstance(node, ast.If) and _is_type_checking(node):
                if not at_import_time:
                    visit(node.body, top)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(ast.iter_child_nodes(node), False)
            else:
                visit(ast.iter_child_nodes(node), top)

    visit(tree.body, True)
    if at_import_time:  # a module's packages run first
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
        for target in list(found):
            parts = target.split(".")
            found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    found.discard(name)
    if at_import_time and MODULES[name].name == "__init__.py":
        found = {target for target in found if not target.startswith(name + ".")}
    return found


def circles(at_import_time: bool) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {name: imports(name, at_import_time) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return out


@pytest.mark.parametrize("at_import_time", [True, False], ids=["at-import-time", "by-design"])
def test_the_package_has_no_import_circles(at_import_time):
    assert circles(at_import_time) == []
