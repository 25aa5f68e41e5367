"""The benchmarks and the report generator are packages run with ``python -m`` from the repository root.

``benchmarks/`` (shared helpers in ``benchmarks.common``) and ``tools/`` (``python -m tools.report``) import each
other's modules as packages: no file edits ``sys.path`` to make a sibling importable, every module imports with
torch and kernels-core alone (vendor packages are imported where a benchmark runs, not at import), and a benchmark
that starts itself again in a child process finds the package from any working directory; their docstring examples
run. Each check runs Python in a subprocess, as a user or CI would.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("benchmarks", "tools")

pytestmark = pytest.mark.skipif(
    not (REPO / "noxfile.py").is_file() or not (REPO / "benchmarks").is_dir(),
    reason="needs the source repository (its benchmarks/ and tools/), not an installed kernels-core",
)


def _python_files() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (REPO / folder).rglob("*.py")
                  if "__pycache__" not in path.parts)


def _module_files() -> dict[str, Path]:
    """Every module of the two packages by import name; ``__main__`` modules run when imported, so not those."""
    modules = {}
    for path in _python_files():
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] != "__main__":
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _path_edits(source: str) -> list[int]:
    """Lines that touch the import path: ``sys.path`` (any use, under any alias of ``sys``), ``from sys import
    path`` and ``site.addsitedir``."""
    tree = ast.parse(source)
    sys_names = {"sys"} | {alias.asname for node in ast.walk(tree) if isinstance(node, ast.Import)
                           for alias in node.names if alias.name == "sys" and alias.asname}
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id in sys_names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "addsitedir":
            lines.append(node.lineno)
    return sorted(lines)


def _env_without_repo() -> dict[str, str]:
    """This environment, minus the repository root on PYTHONPATH: only a working directory or an explicit
    PYTHONPATH set for a child can make the packages importable."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env_without_repo(), capture_output=True, text=True,
                          timeout=300)


def test_the_path_check_sees_every_form():
    source = ("import sys\nimport sys as system\nimport site\nfrom sys import path\nsys.path.insert(0, 'x')\n"
              "system.path.append('y')\nsite.addsitedir('z')\nprint(sys.argv)\n")
    assert _path_edits(source) == [4, 5, 6, 7]


def test_no_file_under_benchmarks_or_tools_edits_the_import_path():
    found = [f"{path.relative_to(REPO)}:{line}" for path in _python_files()
             for line in _path_edits(path.read_text(encoding="utf-8"))]
    assert not found, "import the package instead of editing sys.path:\n" + "\n".join(found)


def test_every_benchmark_and_tool_module_imports():
    modules = list(_module_files())
    assert {"benchmarks.common", "benchmarks.cuda.distributed_bench", "tools.report.generate"} <= set(modules)
    script = ("import importlib, sys\n"
              "for name in sys.argv[1:]:\n"
              "    importlib.import_module(name)\n")
    done = _run("-c", script, *modules)
    assert done.returncode == 0, done.stderr[-4000:]


def test_docstring_examples_run():
    with_examples = [name for name, path in _module_files().items() if ">>> " in path.read_text(encoding="utf-8")]
    assert {"benchmarks.common", "tools.report.data"} <= set(with_examples)
    script = ("import doctest, importlib, sys\n"
              "for name in sys.argv[1:]:\n"
              "    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)\n"
              "    if result.failed or not result.attempted:\n"
              "        sys.exit(f'{name}: {result}')\n")
    done = _run("-c", script, *with_examples)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.parametrize("module", ["benchmarks.cuda.distributed_bench", "benchmarks.cuda.trainer_bench",
                                    "benchmarks.portable.memory", "tools.report"])
def test_runs_as_a_module_from_the_repository_root(module):
    done = _run("-m", module, "--help")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


def test_a_child_process_finds_the_package_from_another_working_directory(tmp_path):
    # The parent imports benchmarks.common from the repository root (its working directory); the child it starts
    # runs in tmp_path, where only the PYTHONPATH of child_env() leads to the package.
    script = ("import importlib, subprocess, sys\n"
              "common = importlib.import_module('benchmarks.common')\n"
              "command = common.python_m('benchmarks.cuda.distributed_bench', '--help')\n"
              "done = subprocess.run(command, cwd=sys.argv[1], env=common.child_env(), capture_output=True,\n"
              "                      text=True)\n"
              "print(done.stdout[:200]); print(done.stderr[-3000:], file=sys.stderr)\n"
              "sys.exit(done.returncode)\n")
    done = _run("-c", script, str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]
