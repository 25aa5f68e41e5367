"""kernels-triton's imports: no cycle between its modules, and importing any of them starts no thread.

The import graph is read from the source with ``ast``: every ``import`` of a package module, at module level or
inside a function (a lazy import still ties the two modules together). The warm-up thread starts when kernelize
binds a kernel (it resolves ``kernels_triton.ops:<name>``), never on import; both are checked in fresh processes
with the GPU check answered yes, since without a GPU nothing would start anyway.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import kernels_triton


PACKAGE = "kernels_triton"
SOURCE = Path(kernels_triton.__file__).parent
MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(kernels_triton.__path__, prefix=f"{PACKAGE}."))


def _module_name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def _imported(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The modules of this package that ``node`` imports (``from . import a, b`` imports both submodules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if node.level:
        # Every module here is directly in the package, so one leading dot is the package itself.
        base = PACKAGE if importer == PACKAGE or node.level == 1 else None
        if base is None:
            raise AssertionError(f"{importer}: relative import above the package")
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
        if target.split(".")[0] != PACKAGE:
            return []
    if target != PACKAGE:
        return [target]
    return [f"{PACKAGE}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (``kernels_triton`` for the package)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(SOURCE.glob("*.py")):
        importer = _module_name(path)
        edges = graph.setdefault(importer, set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(target for target in _imported(node, importer) if target != importer)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_cycle_finder_finds_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_package_relative_imports():
    graph = import_graph()
    # _warmup imports the C++ extension inside a function only; the package imports _specs with `from ._specs`.
    assert f"{PACKAGE}._cpp_extension" in graph[f"{PACKAGE}._warmup"]
    assert f"{PACKAGE}._specs" in graph[PACKAGE]
    assert set(graph) == {PACKAGE, *MODULES}


def test_no_import_cycle_between_package_modules():
    found = cycles(import_graph())
    assert found == [], f"import cycles between kernels_triton modules: {found}"


def _run(script: str) -> subprocess.CompletedProcess:
    # TRITON_INTERPRET as in this suite's conftest (no GPU); the C++ extension's build is never started.
    env_script = textwrap.dedent("""
        import os
        import threading
        import torch
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["KERNELS_TRITON_CPP_AUTOGRAD"] = "0"
        os.environ.pop("KERNELS_TRITON_WARMUP", None)
        torch.cuda.is_available = lambda: True   # the warm-up starts only where there is a GPU: say there is one
        try:
            import triton  # noqa: F401 - its own import is not this package's
        except ImportError:
            pass
    """) + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", env_script], capture_output=True, text=True, timeout=300)


def test_importing_every_module_starts_no_thread():
    proc = _run(f"""
        import importlib
        before = threading.active_count()
        for name in {MODULES!r}:
            try:
                importlib.import_module(name)
            except ImportError as error:   # Triton missing: that module cannot start anything either
                print("skipped", name, error)
        from kernels_triton import _warmup
        assert _warmup._thread is None, "importing kernels_triton started the warm-up thread"
        assert threading.active_count() == before, [t.name for t in threading.enumerate()]
        print("no thread")
    """)
    assert proc.returncode == 0 and "no thread" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_binding_a_triton_kernel_starts_the_warmup():
    # kernelize binds a kernel by resolving its declared reference: a native kernel needs no Triton set-up, a
    # Triton one starts it (here the thread's steps fail without a GPU, which it only logs).
    proc = _run("""
        import pkgutil
        from kernels_triton import _warmup
        pkgutil.resolve_name("kernels_triton.ops:native_rms_norm")
        assert _warmup._thread is None, "binding a native kernel started the warm-up"
        pkgutil.resolve_name("kernels_triton.ops:rms_norm")
        assert _warmup._thread is not None and _warmup._thread.name == "kernels-triton-warmup"
        print("started")
    """)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stdout + proc.stderr[-3000:]
