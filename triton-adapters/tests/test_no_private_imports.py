"""No code outside a package of this repository uses that package's private modules: other packages, benchmarks,
examples and the docs' code go through each package's public modules (``kernels_triton``, ``kernels_triton.ops``,
``kernels_cuda``, ``kernels_cuda.ops``, ``kernels_rocm``, ``kernels_npu``; ``kernels_core``'s own check is
``core/tests/test_public_imports.py``).

Read with ``ast`` from every Python file of the repository outside the package's own folder: imports of a
package's private module (``import <package>.<private>``, ``from <package>.<private> import y``, ``from <package>
import <private>``, a private name being one that starts with an underscore), strings that name a private module or
attribute (a kernel declaration's ``"<package>.<private>:f"``, ``importlib.import_module`` or ``find_spec``
arguments, f-strings included) and Python source held in strings (``python -c`` scripts, docstring examples).
Markdown files are read too: their code blocks, and kernel references anywhere. There is no opt-out, this file
included: its samples spell the underscore as ``{P}`` and fill it in at run time.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
# Each checked package and the folder that owns it (where its private modules may be used).
PACKAGES = {"kernels_triton": "triton-adapters", "kernels_cuda": "plugins-cuda", "kernels_rocm": "plugins-rocm",
            "kernels_npu": "plugins-npu"}
_NAMES = "|".join(PACKAGES)
# A private name's leading underscore in the samples below, filled in at run time so this file names no private
# module itself.
P = "_"


def _patterns(package: str) -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    """A private module path or reference at the start of a string (``"<package>.<private>:f"``), an
    import of a private module written in source text (scripts and examples held in strings, Markdown), and a
    kernel reference to a private module anywhere in text."""
    name = re.escape(package)
    return (re.compile(rf"{name}\._\w"),
            re.compile(rf"\b(?:import\s+{name}\._\w|from\s+{name}\._\w|"
                       rf"from\s+{name}\s+import\s+(?:\(\s*)?(?:\w+\s*,\s*)*_\w)"),
            re.compile(rf"{name}\._\w+:\w"))


PATTERNS = {package: _patterns(package) for package in PACKAGES}
FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1\s*$", re.MULTILINE | re.DOTALL)


def _checked_files(suffix: str) -> Iterator[tuple[Path, tuple[str, ...]]]:
    """Each file with this suffix and the packages whose private modules it must not use (all but its owner's)."""
    for path in sorted(REPO.rglob(f"*{suffix}")):
        relative = path.relative_to(REPO)
        # Hidden folders hold tool state and the A/B harness's copies of other trees (.nox, .git, .abtree).
        if any(part.startswith(".") or part in ("__pycache__", "build", "node_modules") for part in relative.parts):
            continue
        yield path, tuple(package for package, home in PACKAGES.items() if relative.parts[0] != home)


def _private_imports(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.startswith(f"{package}._")]
    if isinstance(node, ast.ImportFrom) and not node.level:
        module = node.module or ""
        if module.startswith(f"{package}._"):
            return [module]
        if module == package:
            return [f"{package}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
    return []


def _problems_in_python(source: str, packages: tuple[str, ...] = tuple(PACKAGES)) -> Iterator[tuple[int, int, str]]:
    """(first line, last line, what) for each use of a private module of one of ``packages`` in this source."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for package in packages:
            reference, import_text, reference_text = PATTERNS[package]
            for module in _private_imports(node, package):
                yield node.lineno, node.end_lineno or node.lineno, f"imports {module}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value
                if reference.match(value.strip()):
                    yield node.lineno, node.end_lineno or node.lineno, f"names {value.strip()!r}"
                elif import_text.search(value) or reference_text.search(value):
                    yield node.lineno, node.end_lineno or node.lineno, "holds source that imports a private module"


def python_problems() -> list[str]:
    problems = []
    for path, packages in _checked_files(".py"):
        for first, _, what in _problems_in_python(path.read_text(), packages):
            problems.append(f"{path.relative_to(REPO)}:{first}: {what}")
    return problems


def _problems_in_markdown(text: str, packages: tuple[str, ...] = tuple(PACKAGES)) -> Iterator[str]:
    """What each private use in this Markdown is: an import in a code block, a kernel reference anywhere."""
    code = "\n".join(match.group(2) for match in FENCE.finditer(text))
    for package in packages:
        _, import_text, reference_text = PATTERNS[package]
        for match in import_text.finditer(code):
            yield f"code imports a private module: {match.group(0)!r}"
        for match in reference_text.finditer(text):
            yield f"names a private kernel reference: {match.group(0)!r}"


def markdown_problems() -> list[str]:
    return [f"{path.relative_to(REPO)}: {what}" for path, packages in _checked_files(".md")
            for what in _problems_in_markdown(path.read_text(), packages)]


pytestmark = pytest.mark.skipif(not (REPO / "plugins-cuda").is_dir(), reason="needs the repository's checkout")


@pytest.mark.parametrize(("source", "found"), [
    (f"from kernels_triton import {P}rms_norm\n", True),
    (f"from kernels_triton import ops, {P}native\n", True),
    (f"import kernels_triton.{P}warmup as w\n", True),
    (f"from kernels_triton.{P}cpp_extension import status\n", True),
    (f"def f():\n    from kernels_triton import {P}loss\n", True),
    (f"impl = 'kernels_triton.{P}native:rms_norm'\n", True),
    (f"impl = f'kernels_triton.{P}experts:moe_experts_{{variant}}'\n", True),
    (f"find_spec('kernels_triton.{P}cpp_extension')\n", True),
    (f"code = 'import sys; from kernels_triton import {P}gated; print(1)'\n", True),
    (f'def f():\n    """Example:\n        >>> from kernels_triton import {P}warmup\n    """\n', True),
    ("from kernels_triton import ops\nfrom kernels_triton.ops import rms_norm\n", False),
    # Other packages' samples are one line without a newline (or joined at run time): core's test of declared test
    # dependencies reads multi-line string constants as scripts, and triton-adapters does not depend on these.
    (f"from kernels_cuda import {P}ops", True),
    (f"import kernels_rocm.{P}plugin", True),
    (f"from kernels_npu.{P}rms_norm import npu_rms_norm", True),
    (f"impl = 'kernels_npu.{P}swiglu:swiglu'", True),
    ("\n".join(["from kernels_cuda import ops", "from kernels_cuda.ops import set_rms_norm_thresholds"]), False),
    ("from kernels_npu import detect_npu", False),
    ("impl = 'kernels_triton.ops:rms_norm'\n", False),
    ("from kernels_triton import liger_kernel_specs\n", False),
    (f'"""kernels-triton\'s ops, not kernels_triton.{P}private"""\n', False),
])
def test_the_check_finds_private_uses(source, found):
    assert bool(list(_problems_in_python(source))) is found


@pytest.mark.parametrize(("text", "found"), [
    (f"Use it:\n\n```python\nfrom kernels_triton import {P}rms_norm\n```\n", True),
    (f"Declare `impl=\"kernels_triton.{P}native:rms_norm\"`.\n", True),
    (f"```python\nfrom kernels_cuda import {P}ops\n```\n", True),
    ("```python\nfrom kernels_triton import ops\nops.rms_norm\n```\nPrivate modules such as `_rms_norm` hold them.\n",
     False),
])
def test_the_check_reads_markdown_code_and_references(text, found):
    assert bool(list(_problems_in_markdown(text))) is found


def test_no_python_outside_a_package_uses_its_private_modules():
    found = python_problems()
    assert found == [], "use the package's public modules (its top level, its ops) instead:\n" + "\n".join(found)


def test_no_documentation_code_uses_a_package_private_modules():
    found = markdown_problems()
    assert found == [], "use the package's public modules (its top level, its ops) instead:\n" + "\n".join(found)
