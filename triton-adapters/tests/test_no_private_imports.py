"""No code outside kernels-triton uses its private modules: other packages, benchmarks, examples and the docs' code
go through ``kernels_triton`` and ``kernels_triton.ops``.

Read with ``ast`` from every Python file of the repository outside ``triton-adapters/``: imports (``import
kernels_triton._x``, ``from kernels_triton._x import y``, ``from kernels_triton import _x``), strings that name a
private module or attribute (a kernel declaration's ``"kernels_triton._x:f"``, ``importlib.import_module`` or
``find_spec`` arguments, f-strings included) and Python source held in strings (``python -c`` scripts, docstring
examples). Markdown files are read too: their code blocks, and kernel references anywhere. There is no opt-out.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
OWN_PACKAGE = REPO / "triton-adapters"
# A private module path or reference at the start of a string: "kernels_triton._rms_norm:rms_norm".
PRIVATE_REFERENCE = re.compile(r"kernels_triton\._\w")
# An import of a private module written in source text (scripts and examples held in strings, Markdown).
PRIVATE_IMPORT_TEXT = re.compile(r"\b(?:import\s+kernels_triton\._\w|from\s+kernels_triton\._\w|"
                                 r"from\s+kernels_triton\s+import\s+(?:\(\s*)?(?:\w+\s*,\s*)*_\w)")
PRIVATE_REFERENCE_TEXT = re.compile(r"kernels_triton\._\w+:\w")
FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1\s*$", re.MULTILINE | re.DOTALL)


def _checked_files(suffix: str) -> Iterator[Path]:
    for path in sorted(REPO.rglob(f"*{suffix}")):
        relative = path.relative_to(REPO)
        # Hidden folders hold tool state and the A/B harness's copies of other trees (.nox, .git, .abtree).
        if any(part.startswith(".") or part in ("__pycache__", "build", "node_modules") for part in relative.parts):
            continue
        if path.is_relative_to(OWN_PACKAGE):
            continue
        yield path


def _private_imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.startswith("kernels_triton._")]
    if isinstance(node, ast.ImportFrom) and not node.level:
        module = node.module or ""
        if module.startswith("kernels_triton._"):
            return [module]
        if module == "kernels_triton":
            return [f"kernels_triton.{alias.name}" for alias in node.names if alias.name.startswith("_")]
    return []


def _problems_in_python(source: str) -> Iterator[tuple[int, int, str]]:
    """(first line, last line, what) for each use of a private kernels_triton name in this Python source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for module in _private_imports(node):
            yield node.lineno, node.end_lineno or node.lineno, f"imports {module}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if PRIVATE_REFERENCE.match(value.strip()):
                yield node.lineno, node.end_lineno or node.lineno, f"names {value.strip()!r}"
            elif PRIVATE_IMPORT_TEXT.search(value) or PRIVATE_REFERENCE_TEXT.search(value):
                yield node.lineno, node.end_lineno or node.lineno, "holds source that imports a private module"


def python_problems() -> list[str]:
    problems = []
    for path in _checked_files(".py"):
        for first, _, what in _problems_in_python(path.read_text()):
            problems.append(f"{path.relative_to(REPO)}:{first}: {what}")
    return problems


def _problems_in_markdown(text: str) -> Iterator[str]:
    """What each private use in this Markdown is: an import in a code block, a kernel reference anywhere."""
    code = "\n".join(match.group(2) for match in FENCE.finditer(text))
    for match in PRIVATE_IMPORT_TEXT.finditer(code):
        yield f"code imports a private module: {match.group(0)!r}"
    for match in PRIVATE_REFERENCE_TEXT.finditer(text):
        yield f"names a private kernel reference: {match.group(0)!r}"


def markdown_problems() -> list[str]:
    return [f"{path.relative_to(REPO)}: {what}" for path in _checked_files(".md")
            for what in _problems_in_markdown(path.read_text())]


pytestmark = pytest.mark.skipif(not (REPO / "plugins-cuda").is_dir(), reason="needs the repository's checkout")


@pytest.mark.parametrize(("source", "found"), [
    ("from kernels_triton import _rms_norm\n", True),
    ("from kernels_triton import ops, _native\n", True),
    ("import kernels_triton._warmup as w\n", True),
    ("from kernels_triton._cpp_extension import status\n", True),
    ("def f():\n    from kernels_triton import _loss\n", True),
    ("impl = 'kernels_triton._native:rms_norm'\n", True),
    ("impl = f'kernels_triton._experts:moe_experts_{variant}'\n", True),
    ("find_spec('kernels_triton._cpp_extension')\n", True),
    ("code = 'import sys; from kernels_triton import _gated; print(1)'\n", True),
    ('def f():\n    """Example:\n        >>> from kernels_triton import _warmup\n    """\n', True),
    ("from kernels_triton import ops\nfrom kernels_triton.ops import rms_norm\n", False),
    ("impl = 'kernels_triton.ops:rms_norm'\n", False),
    ("from kernels_triton import liger_kernel_specs\n", False),
    ('"""kernels-triton\'s ops, not kernels_triton._private"""\n', False),
])
def test_the_check_finds_private_uses(source, found):
    assert bool(list(_problems_in_python(source))) is found


@pytest.mark.parametrize(("text", "found"), [
    ("Use it:\n\n```python\nfrom kernels_triton import _rms_norm\n```\n", True),
    ("Declare `impl=\"kernels_triton._native:rms_norm\"`.\n", True),
    ("```python\nfrom kernels_triton import ops\nops.rms_norm\n```\nPrivate modules such as `_rms_norm` hold them.\n",
     False),
])
def test_the_check_reads_markdown_code_and_references(text, found):
    assert bool(list(_problems_in_markdown(text))) is found


def test_no_python_outside_kernels_triton_uses_its_private_modules():
    found = python_problems()
    assert found == [], "use kernels_triton.ops or the package's top level instead:\n" + "\n".join(found)


def test_no_documentation_code_uses_kernels_triton_private_modules():
    found = markdown_problems()
    assert found == [], "use kernels_triton.ops or the package's top level instead:\n" + "\n".join(found)
