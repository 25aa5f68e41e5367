"""Docstring examples are runnable: kernels-triton's and the GPU plugins' examples execute on this machine.

On CPU the adapter examples exercise their native fallbacks (their docstrings say so); examples that need a GPU
are marked ``+SKIP`` in the docstring itself.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import kernels_triton
import pytest


# Modules whose public API documents itself with examples; each must keep at least one that runs.
WITH_EXAMPLES = {"kernels_triton", "kernels_triton.ops", "kernels_triton._specs", "kernels_triton._native",
                 "kernels_triton._device", "kernels_triton._gated", "kernels_triton._combine",
                 "kernels_triton._rms_norm", "kernels_triton._norm_kernels", "kernels_triton._residual_rms_norm",
                 "kernels_triton._rotary", "kernels_triton._warmup", "kernels_triton._cpp_extension",
                 "kernels_triton._loss"}
MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(kernels_triton.__path__, prefix="kernels_triton."))


@pytest.mark.parametrize("name", ["kernels_triton", *MODULES])
def test_examples_run(name):
    if name in ("kernels_triton.ops", "kernels_triton._launch", "kernels_triton._combine", "kernels_triton._rms_norm",
                "kernels_triton._norm_kernels", "kernels_triton._residual_rms_norm", "kernels_triton._rotary",
                "kernels_triton._gated", "kernels_triton._cpp_extension"):
        pytest.importorskip("triton", reason="kernels-triton's own kernels need Triton")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
    if name in WITH_EXAMPLES:
        assert result.attempted > 0, f"{name} lost its docstring examples"
