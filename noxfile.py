"""Test sessions, one per package, each in a fresh pip-based venv holding only the core and that package.

    nox -s tests                        # every package
    nox -s "tests(vendor='npu')"        # one package
    nox -s tests -- -x -k rotary        # arguments after -- go to pytest
    nox --no-venv --no-install -s "tests(vendor='cuda')"   # on a machine whose Python already has everything

pip-based venvs (virtualenv), not uv: CI machines reach only PyPI plus a local CPU build of torch that pip is
pointed at; uv would ignore it and download a multi-GB CUDA build of torch.
"""

from __future__ import annotations

from pathlib import Path

import nox


nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests"]

ROOT = Path(__file__).parent
# What each session installs (beyond pytest) and which test folders it runs. Each vendor gets the core and
# its own packages only, so an import of another vendor's code or an undeclared dependency fails here.
PACKAGES: dict[str, tuple[list[str], list[str]]] = {
    "core": (["./core[test]", "./examples/example-plugin"],
             ["core/tests", "examples/example-plugin/tests", "--ignore=core/tests/integrations"]),
    "cuda": (["./core[test]", "./triton-adapters", "./plugins-cuda"], ["triton-adapters/tests", "plugins-cuda/tests"]),
    "rocm": (["./core[test]", "./triton-adapters", "./plugins-rocm"], ["plugins-rocm/tests"]),
    "npu": (["./core[test]", "./plugins-npu"], ["plugins-npu/tests"]),
    # The trainer integrations (transformers Trainer, TRL, accelerate) with the core's portable kernels.
    "integrations": (["./core[test,trl]"],
                     ["core/tests/integrations", "--ignore=core/tests/integrations/llamafactory"]),
    # LLaMA-Factory pins older transformers / accelerate / trl, so it gets a venv of its own.
    "llamafactory": (["./core[test,llamafactory]"], ["core/tests/integrations/llamafactory"]),
}


@nox.session
@nox.parametrize("vendor", list(PACKAGES), ids=None)
def tests(session: nox.Session, vendor: str) -> None:
    """Run one package's test suite in a venv holding only the core and that package."""
    installs, test_dirs = PACKAGES[vendor]
    missing = [path for path in installs if not (ROOT / path.split("[")[0]).exists()]
    if missing:
        session.error(f"package folders missing for vendor {vendor!r}: {missing}")
    if session.venv_backend != "none":
        session.install("pytest>=8", *installs)
    # -rs: every skipped test says why (GPU tests on CPU-only CI, for one).
    session.run("python", "-m", "pytest", *test_dirs, "-p", "no:cacheprovider", "-rs", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over every package."""
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", ".")
