"""Every package's tests need only what that package declares: its dependencies plus its ``test`` extra.

``pip install -e "<package>[test]"`` then ``pytest`` must pass (or skip, saying why) for each package of this
repository. This reads each package's tests (every ``.py`` under ``tests/``: imports at any depth, inside functions
too, worker scripts, and the source of ``python -c`` scripts held in string constants) and checks each third-party
module they import against the distributions that package's ``pyproject.toml`` declares. A module the tests only
reach through ``pytest.importorskip(module, reason=...)`` (in the same file or a ``conftest.py`` above it) is
optional: those tests skip, saying why, where it is missing.

What imports alone cannot show: a dependency imported lazily inside a library the tests call (transformers'
``from_pretrained(tp_plan=...)`` needs accelerate, which the test never imports). The cases known are listed in
``IMPLIED_BY_KEYWORD`` and ``IMPLIED_BY_IMPORT`` below; others are not seen. The nox
sessions (noxfile.py) install each tested package with its ``test`` extra; the last test checks that too.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement


if sys.version_info >= (3, 11):
    import tomllib
else:  # kernels-core depends on tomli there
    import tomli as tomllib


REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "triton-adapters", "plugins-cuda", "plugins-rocm", "plugins-npu", "examples/example-plugin")

# Third-party top-level module -> distributions that make it importable: the one shipping it, then widely used ones
# that require it unconditionally (so declaring those is enough). Keep this to modules the tests import; an unknown
# module fails the test below rather than passing unchecked.
PROVIDERS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "accelerate": ("accelerate",),
    "pytest": ("pytest",),
    "pluggy": ("pluggy",),
    "packaging": ("packaging",),
    "tomli": ("tomli",),
    "liger_kernel": ("liger-kernel",),
    "triton": ("triton", "liger-kernel"),  # liger-kernel requires triton
    "tokenizers": ("tokenizers", "transformers"),  # transformers requires tokenizers
    "yaml": ("pyyaml", "transformers", "accelerate"),
    "numpy": ("numpy", "transformers", "accelerate"),
    "trl": ("trl",),
    "datasets": ("datasets", "trl"),  # trl requires datasets
    "peft": ("peft",),
    "llamafactory": ("llamafactory",),
    "torch_npu": ("torch-npu",),
    "bitsandbytes": ("bitsandbytes",),
    "torchgen": ("torch",),  # torch ships torchgen
    "deepspeed": ("deepspeed",),
    "torchao": ("torchao",),
}
# The repository's own folders of scripts (no distribution ships them): importable from a checkout only, so a test
# must reach them through importorskip with a reason.
REPOSITORY_MODULES = {"tools", "benchmarks"}
# Distributions a test needs without importing them. transformers imports accelerate lazily and raises without it
# for from_pretrained(device_map=...) / (tp_plan=...) and for its Trainer and TrainingArguments; kernels-core's
# testing helpers build transformers models (kernels-core itself does not depend on transformers).
IMPLIED_BY_KEYWORD = {"device_map": "accelerate", "tp_plan": "accelerate"}
IMPLIED_BY_IMPORT = {
    ("transformers", "Trainer"): "accelerate",
    ("transformers", "TrainingArguments"): "accelerate",
    ("kernels_core.testing", "tiny_causal_lm"): "transformers",
    ("kernels_core.testing", "assert_conforms"): "transformers",
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject(package: str) -> dict:
    return tomllib.loads((REPO / package / "pyproject.toml").read_text())


def _first_party() -> dict[str, tuple[str, str]]:
    """Import name -> (distribution, package folder), for this repository's packages."""
    found = {}
    for package in PACKAGES:
        for src in sorted((REPO / package / "src").iterdir()):
            if (src / "__init__.py").is_file():
                found[src.name] = (_normalize(_pyproject(package)["project"]["name"]), package)
    return found


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalize(Requirement(req).name) for req in requirements}


def _declared(package: str) -> set[str]:
    """The package itself, its dependencies and test extra, plus (recursively) the dependencies of this repository's
    packages it depends on, whose pyproject.toml files are right here."""
    project = _pyproject(package)["project"]
    declared = {_normalize(project["name"])} | _requirement_names(project.get("dependencies", []))
    declared |= _requirement_names(project.get("optional-dependencies", {}).get("test", []))
    by_distribution = {dist: folder for dist, folder in _first_party().values()}
    pending = [name for name in declared if name in by_distribution]
    while pending:
        folder = by_distribution[pending.pop()]
        for name in _requirement_names(_pyproject(folder)["project"].get("dependencies", [])):
            if name not in declared:
                declared.add(name)
                if name in by_distribution:
                    pending.append(name)
    return declared


def _trees(path: Path) -> Iterator[ast.AST]:
    """The file's syntax tree, then that of every string constant holding Python code with an import (a script
    for ``python -c``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"[\n;]", node.value):
            try:
                embedded = ast.parse(node.value)
            except SyntaxError:
                continue
            if any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(embedded)):
                yield embedded


def _needs(path: Path) -> tuple[dict[str, int], dict[str, bool]]:
    """(top-level module -> first line needing it, module -> whether an importorskip of it gives a reason; a
    ``find_spec`` check of it counts as one)."""
    needs: dict[str, int] = {}
    skips: dict[str, bool] = {}

    def need(module: str, line: int) -> None:
        needs.setdefault(module.split(".")[0], line)

    for tree in _trees(path):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    need(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                need(node.module, node.lineno)
                for alias in node.names:
                    if (implied := IMPLIED_BY_IMPORT.get((node.module, alias.name))) is not None:
                        need(implied, node.lineno)
            elif isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg in IMPLIED_BY_KEYWORD:
                        need(IMPLIED_BY_KEYWORD[keyword.arg], node.lineno)
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name == "importorskip" and node.args and isinstance(node.args[0], ast.Constant):
                    module = str(node.args[0].value).split(".")[0]
                    need(module, node.lineno)
                    skips[module] = skips.get(module, False) or any(k.arg == "reason" for k in node.keywords)
                elif name == "find_spec" and node.args and isinstance(node.args[0], ast.Constant):
                    # importlib.util.find_spec("x") is None: the tests ask before they import (skipif, skip).
                    module = str(node.args[0].value).split(".")[0]
                    skips[module] = True
    return needs, skips


def _local_modules(tests: Path) -> set[str]:
    """Modules the tests import from their own folders (helpers, worker scripts, emulations)."""
    return {p.stem for p in tests.rglob("*.py")} | {p.parent.name for p in tests.rglob("__init__.py")}


def _undeclared(package: str) -> list[str]:
    tests = REPO / package / "tests"
    local = _local_modules(tests)
    first_party = _first_party()
    declared = _declared(package)
    problems = []
    for path in sorted(tests.rglob("*.py")):
        needs, skips = _needs(path)
        # importorskip in a conftest.py guards every test file below it.
        for conftest in (p / "conftest.py" for p in path.parents if p.is_relative_to(tests)):
            if conftest.is_file() and conftest != path:
                for module, has_reason in _needs(conftest)[1].items():
                    skips[module] = skips.get(module, False) or has_reason
        # A script run in a subprocess (a worker) is guarded by importorskip in the test files that name it.
        for launcher in tests.rglob("test_*.py"):
            if launcher != path and path.name in launcher.read_text():
                for module, has_reason in _needs(launcher)[1].items():
                    skips[module] = skips.get(module, False) or has_reason
        where = path.relative_to(REPO)
        for module, line in sorted(needs.items()):
            if module in sys.stdlib_module_names or module == "__future__" or module in local:
                continue
            if module in REPOSITORY_MODULES:
                if not skips.get(module):
                    problems.append(f"{where}:{line}: {module!r} exists only in a checkout: importorskip it with a "
                                    "reason")
                continue
            if module in first_party:
                providers: tuple[str, ...] = (first_party[module][0],)
            elif module in PROVIDERS:
                providers = tuple(_normalize(d) for d in PROVIDERS[module])
            else:
                problems.append(f"{where}:{line}: unknown module {module!r}: add it to PROVIDERS in {__file__}")
                continue
            if any(p in declared for p in providers):
                continue
            if module not in skips:
                problems.append(f"{where}:{line}: needs {providers[0]!r}, which {package}/pyproject.toml declares "
                                "neither as a dependency nor in its test extra, and no pytest.importorskip guards it")
            elif not skips[module]:
                problems.append(f"{where}: pytest.importorskip({module!r}) of an undeclared module gives no reason=")
    return problems


requires_repository = pytest.mark.skipif(
    not all((REPO / package / "pyproject.toml").is_file() for package in PACKAGES),
    reason="needs the source repository (every package's pyproject.toml), not an installed kernels-core",
)


@requires_repository
@pytest.mark.parametrize("package", PACKAGES)
def test_tests_import_only_declared_distributions(package):
    assert "test" in _pyproject(package)["project"].get("optional-dependencies", {}), \
        f"{package}/pyproject.toml has no test extra"
    problems = _undeclared(package)
    assert not problems, "\n".join(problems)


@requires_repository
def test_the_check_sees_imports_inside_functions_and_implied_dependencies(tmp_path):
    """The parser itself: a nested import and a device_map= call are both seen; importorskip with a reason guards."""
    script = tmp_path / "worker.py"
    script.write_text("import pytest\nyaml = pytest.importorskip('yaml', reason='r')\n"
                      "def main():\n    import accelerate.utils\n    load(path, device_map='auto')\n"
                      "    from transformers import Trainer\n    from kernels_core.testing import tiny_causal_lm\n")
    needs, skips = _needs(script)
    assert needs == {"pytest": 1, "yaml": 2, "accelerate": 4, "transformers": 6, "kernels_core": 7}
    assert skips == {"yaml": True}


@requires_repository
def test_nox_sessions_install_the_test_extra_of_every_package_they_test():
    tree = ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8"))
    (sessions,) = (ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.AnnAssign)
                   and getattr(node.target, "id", None) == "PACKAGES")
    problems = []
    for session, (installs, test_paths) in sessions.items():
        installed = {}
        for spec in installs:
            folder, _, extras = spec.removeprefix("./").partition("[")
            installed[folder] = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}
        for path in test_paths:
            if path.startswith("-"):
                continue
            (package,) = (p for p in PACKAGES if path == f"{p}/tests" or path.startswith(f"{p}/tests/"))
            if "test" not in installed.get(package, set()):
                problems.append(f"session {session!r} runs {path} without installing ./{package}[test]")
    assert not problems, "\n".join(problems)
