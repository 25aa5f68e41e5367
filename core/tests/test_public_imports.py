"""Packages import each other's public names only: no ``kernels_core._*`` import outside ``core/`` (private modules
may change in any release). ``triton-adapters/tests/test_no_private_imports.py`` does the same for the
private modules of ``kernels_triton``, ``kernels_cuda``, ``kernels_rocm`` and ``kernels_npu``, strings and Markdown
included."""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
SKIP = {".git", ".nox", ".venv", "venv", "build", "dist", "site", "node_modules"}


def _private_imports(package: str, home: str) -> list[str]:
    """``path:line: module`` for every import of a private module of ``package`` in a .py file outside ``home``."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] == home or SKIP & set(relative.parts) or any(p.startswith(".") for p in relative.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == package and any(part.startswith("_") for part in parts[1:]):
                    found.append(f"{relative}:{node.lineno}: {name}")
    return found


def test_no_private_kernels_core_import_outside_core():
    assert _private_imports("kernels_core", "core") == []

