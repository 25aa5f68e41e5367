"""Docstring examples are runnable: every module's examples execute against the installed package."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import kernels_core
import pytest


# Modules whose public API documents itself with examples; they must keep at least one that runs.
WITH_EXAMPLES = {"kernels_core", "kernels_core._types", "kernels_core._config", "kernels_core._report",
                 "kernels_core._kernelize", "kernels_core.portable", "kernels_core.testing",
                 "kernels_core._plugins._manager", "kernels_core.plugin", "kernels_core._errors",
                 "kernels_core.optim"}
MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(kernels_core.__path__, prefix="kernels_core.")
    if name != "kernels_core._cli"  # its examples are the README's shell commands
)


@pytest.mark.parametrize("name", ["kernels_core", *MODULES])
def test_examples_run(name):
    pytest.importorskip("transformers")
    if name in ("kernels_core.integrations.llamafactory", "kernels_core.integrations._llamafactory"):
        pytest.importorskip("llamafactory", reason="LLaMA-Factory is not installed (its own nox session runs these)")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
    if name in WITH_EXAMPLES:
        assert result.attempted > 0, f"{name} lost its docstring examples"
