"""No import cycles among the modules of a package, read from the source with ``ast`` (nothing is imported).

Module-level, function-level and ``if TYPE_CHECKING:`` imports all count: a function-level import only delays a
cycle to the first call, and one for annotations alone never runs, yet the modules on either cannot be understood,
tested or moved one without the other. The import of a parent package that importing a submodule implies does not
count: Python finishes the parent's ``__init__`` before the submodule runs, so that edge cannot close a cycle; an
explicit ``from package import name`` does count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kernels_core": ROOT / "core" / "src" / "kernels_core",
    "kernels_triton": ROOT / "triton-adapters" / "src" / "kernels_triton",
}


def _module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads: modules, or ``module.attribute`` for a name taken from one."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" for alias in node.names]


def import_graph(package_dir: Path) -> dict[str, dict[str, str]]:
    """module -> {module of the same package it imports: "file:line" of the first such import}."""
    files = {_module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for module, path in files.items():
        edges: dict[str, str] = {}
        pending: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
        while pending:
            node = pending.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, module, path.name == "__init__.py"):
                    # ``from package import name`` takes a submodule when there is one, else an attribute.
                    while name and name not in files:
                        name = name.rpartition(".")[0]
                    if name and name != module:
                        edges.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
            pending.extend(ast.iter_child_nodes(node))
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_both_kinds_of_import():
    graph = import_graph(PACKAGES["kernels_core"])
    assert "kernels_core._types" in graph["kernels_core._resolve"], "a module-level import"
    assert "kernels_core._kernelize" in graph["kernels_core"], "a function-level import (the lazy kernelize)"
    assert cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", ["kernels_core", "kernels_triton"])
def test_no_import_cycles(package):
    graph = import_graph(PACKAGES[package])
    problems = []
    for component in cycles(graph):
        members = set(component)
        edges = [f"{a} -> {b} ({where})" for a in component for b, where in graph[a].items() if b in members]
        problems.append(f"cycle among {component}:\n    " + "\n    ".join(edges))
    assert not problems, "\n".join(problems)
