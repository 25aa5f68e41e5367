"""Test sessions, one per package, each in a fresh pip-based venv holding only the core and that package.

    nox                                 # every package's tests, then the documentation site (what CI runs)
    nox -s tests                        # every package
    nox -s "tests(vendor='npu')"        # one package
    nox -s tests -- -x -k rotary        # arguments after -- go to pytest
    nox --no-venv --no-install -s "tests(vendor='cuda')"   # on a machine whose Python already has everything
    nox -s docs                         # mkdocs build --strict into build/docs-site

One torch for all venvs: torch (with only what torch itself requires) is installed once, with
`pip install --target`, into `.nox/_shared-torch/<python>-<spec>/`, and every session venv gets a `.pth` file
naming that folder. Everything else a session needs is installed into its own venv, which comes first on
`sys.path`: an undeclared dependency still fails, and a package that needs another torch gets it in its own venv.
Which torch: `torch==2.13.0` where pip can take it (a CPU build lies on the CI machines' disk), else plain
`torch`. The environment variable KERNELS_CORE_NOX_TORCH overrides this with one pip requirement
(`KERNELS_CORE_NOX_TORCH="torch==2.14.1"`), or with `none` to install torch into every venv separately.

pip-based venvs (virtualenv), not uv: CI machines reach only PyPI plus a local CPU build of torch that pip is
pointed at; uv would ignore it and download a multi-GB CUDA build of torch.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nox
import nox.command


nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "docs"]
# The documentation toolchain, as verified with `mkdocs build --strict`.
DOCS_PACKAGES = ["mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11"]

ROOT = Path(__file__).parent
# What each session installs (beyond pytest) and which test folders it runs. Each vendor gets the core and
# its own packages only, so an import of another vendor's code or an undeclared dependency fails here. A package
# whose tests a session runs is installed with its `test` extra (core/tests/test_test_extras.py checks this).
PACKAGES: dict[str, tuple[list[str], list[str]]] = {
    # PEFT too: the report's truth after get_peft_model / merge_and_unload is checked in the core's own tests.
    "core": (["./core[test,peft]", "./examples/example-plugin[test]"],
             ["core/tests", "examples/example-plugin/tests", "--ignore=core/tests/integrations"]),
    "cuda": (["./core[test]", "./triton-adapters[test]", "./plugins-cuda[test]"],
             ["triton-adapters/tests", "plugins-cuda/tests"]),
    "rocm": (["./core[test]", "./triton-adapters", "./plugins-rocm[test]"], ["plugins-rocm/tests"]),
    # Both GPU plugins in one venv (a machine may have both installed): each claims only its own torch build's
    # devices. A venv of its own, so the rocm and cuda venvs still catch an import of the other vendor.
    "rocm+cuda": (["./core[test]", "./triton-adapters", "./plugins-rocm[test]", "./plugins-cuda"],
                  ["plugins-rocm/tests/test_with_cuda_plugin.py"]),
    "npu": (["./core[test]", "./plugins-npu[test]"], ["plugins-npu/tests"]),
    # The trainer integrations (transformers Trainer, TRL, PEFT, QLoRA through bitsandbytes' CPU 4-bit, accelerate)
    # with the core's portable kernels.
    "integrations": (["./core[test,trl,peft,qlora]"],
                     ["core/tests/integrations", "--ignore=core/tests/integrations/llamafactory"]),
    # LLaMA-Factory v1 (llamafactory 0.9.5) pins transformers <= 5.6, so it gets a venv of its own, with what
    # PYPI_PINS lists; the core's matching (kinds/) and distributed tests run again there, on transformers 5.6.
    "llamafactory": (["./core[test]"], ["core/tests/integrations/llamafactory", "core/tests/kinds",
                                        "core/tests/distributed"]),
}
# PyPI packages a session installs after its folders, at the versions its tests passed with: (with their
# dependencies, without). llamafactory's own dependency set (torchvision, torchaudio, gradio, ...) does not install
# beside the CPU build of torch; its model loading and SFT need only these.
PYPI_PINS: dict[str, tuple[list[str], list[str]]] = {
    # QLoRA on the CPU (4-bit nf4 through bitsandbytes' CPU backend); without it those tests skip.
    "integrations": (["bitsandbytes==0.50.2"], []),
    "llamafactory": (["transformers==5.6.0", "accelerate==1.11.0", "omegaconf==2.4.0", "datasets==4.0.0",
                      "torchdata==0.11.0"], ["llamafactory==0.9.5"]),
}


TORCH_ENV = "KERNELS_CORE_NOX_TORCH"
TORCH_SPECS = ("torch==2.13.0", "torch")  # tried in order; the first pip can install is used


def _install_shared_torch(session: nox.Session) -> None:
    """Point this venv at the shared torch folder (a `.pth` file), installing torch there first if needed."""
    chosen = os.environ.get(TORCH_ENV, "").strip()
    if chosen.lower() == "none":
        return
    specs = (chosen,) if chosen else TORCH_SPECS
    # Read off the venv's layout rather than asked of its python, which --install-only would skip.
    venv = Path(session.virtualenv.location)
    found = sorted(venv.glob("lib/python3.*/site-packages")) or sorted(venv.glob("Lib/site-packages"))
    if not found:
        session.error(f"shared torch: no site-packages folder in {venv}")
    site_packages = found[0]
    python_tag = "py" + (site_packages.parent.name.removeprefix("python") if site_packages.parent.name != "Lib"
                         else "win")
    shared = venv.parent / "_shared-torch"
    for spec in specs:
        target = shared / f"{python_tag}-{re.sub(r'[^A-Za-z0-9.]+', '-', spec)}"
        if not target.is_dir():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            try:
                session.run_install("python", "-m", "pip", "install", "--quiet", "--target", str(partial), spec)
            except nox.command.CommandFailed:
                session.log(f"shared torch: pip could not install {spec!r}" + (", trying the next" if
                            spec != specs[-1] else ""))
                shutil.rmtree(partial, ignore_errors=True)
                continue
            if partial.is_dir():  # absent under --no-install
                partial.rename(target)
        if target.is_dir():
            Path(site_packages, "_kernels_core_shared_torch.pth").write_text(f"{target}\n")
            session.log(f"shared torch: {target}")
            return
    session.error(f"shared torch: pip installed none of {list(specs)}; set {TORCH_ENV} to a requirement "
                  "pip can install, or to 'none' to install torch in every venv")


@nox.session
@nox.parametrize("vendor", list(PACKAGES), ids=None)
def tests(session: nox.Session, vendor: str) -> None:
    """Run one package's test suite in a venv holding only the core and that package."""
    installs, test_dirs = PACKAGES[vendor]
    missing = [path for path in installs if not (ROOT / path.split("[")[0]).exists()]
    if missing:
        session.error(f"package folders missing for vendor {vendor!r}: {missing}")
    if session.venv_backend != "none":
        _install_shared_torch(session)
        session.install("pytest>=8", *installs)
        pins, pins_without_deps = PYPI_PINS.get(vendor, ([], []))
        if pins:
            session.install(*pins)
        if pins_without_deps:
            session.install("--no-deps", *pins_without_deps)
    # -rs: every skipped test says why (GPU tests on CPU-only CI, for one).
    session.run("python", "-m", "pytest", *test_dirs, "-p", "no:cacheprovider", "-rs", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml), built strictly: a broken link or an undescribed config key fails."""
    if session.venv_backend != "none":
        session.install(*DOCS_PACKAGES)
    session.run("python", "-m", "mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over every package."""
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", ".")
