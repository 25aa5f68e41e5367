"""Helpers for plugin test suites: reference math, tolerances and tiny transformers models built from configs.

Example:
    >>> import torch
    >>> from kernels_core.testing import reference, tolerance
    >>> x, w = torch.randn(3, 8), torch.ones(8)
    >>> y = reference.rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")
    >>> tolerance(torch.bfloat16) > tolerance(torch.float32)
    True
"""

from __future__ import annotations

from typing import Any

import torch

from ._check import CheckReport
from ._check import check
from ._check import tolerance
from ._config import ENV_CONFIG
from ._config import ENV_DISABLE
from ._config import ENV_STRICT_CONFIG
from ._kinds import _reference as reference
from ._kinds._conformance import FAMILIES
from ._kinds._conformance import tiny_causal_lm
from ._kinds._conformance import tiny_family_causal_lm
from ._plugins._fallbacks import reset_fallbacks
from ._plugins._loading import ENV_ALLOW
from ._plugins._loading import ENV_BLOCK
from ._plugins._loading import ENV_STRICT
from ._plugins._loading import ENV_TRACE
from ._plugins._manager import KernelsPluginManager
from ._types import ConformanceCase
from .integrations._llamafactory_tiny import save_tiny_chat_model
from .integrations._llamafactory_tiny import write_tiny_sft_dataset


__all__ = [
    "ENVIRONMENT_VARIABLES",
    "FAMILIES",
    "ConformanceCase",
    "assert_close",
    "assert_conforms",
    "fresh_plugin_manager",
    "isolate_environment",
    "reference",
    "save_tiny_chat_model",
    "tiny_causal_lm",
    "tiny_family_causal_lm",
    "tolerance",
    "write_tiny_sft_dataset",
]

# Every environment variable kernels-core reads; a test suite clears them so the developer's shell and the
# checkout's own kernels.toml / pyproject.toml cannot change what a test sees.
ENVIRONMENT_VARIABLES = (ENV_CONFIG, ENV_DISABLE, ENV_STRICT_CONFIG, ENV_ALLOW, ENV_BLOCK, ENV_STRICT, ENV_TRACE)

def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
                 factor: float = 1.0, what: str = "") -> None:
    """Assert ``max|a - e| / max|e| <= factor * tolerance(dtype)``; NaNs never pass."""
    dtype = dtype or expected.dtype
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    a, e = actual.detach().double(), expected.detach().double()
    err = float((a - e).abs().max() / e.abs().max().clamp_min(1e-12))
    bound = factor * tolerance(dtype)
    assert err <= bound, f"{what}: relative error {err:.3e} exceeds {bound:.1e} ({dtype})"


def fresh_plugin_manager(*plugins: tuple[object, str], portable: bool = True) -> KernelsPluginManager:
    """A manager with the built-in plugin (and the portable kernels) plus ``(plugin, name)`` pairs, no discovery."""
    from . import _builtin
    from ._builtin import portable as portable_plugin

    pm = KernelsPluginManager(load_entrypoints=False, strict=True, allow=None, block=())
    pm.register(_builtin, "builtin")
    if portable:
        pm.register(portable_plugin, "portable")
    for plugin, name in plugins:
        pm.register(plugin, name)
    return pm


def isolate_environment(monkeypatch: Any, directory: Any) -> None:
    """Clear kernels-core's environment variables and work in ``directory`` (pytest ``monkeypatch``, ``tmp_path``).

    Example:
        >>> @pytest.fixture(autouse=True)  # doctest: +SKIP
        ... def _isolated(monkeypatch, tmp_path):
        ...     isolate_environment(monkeypatch, tmp_path)
    """
    for name in ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(directory)
    # Fallback warnings are issued once per process; each test starts as a fresh process would.
    reset_fallbacks()


def assert_conforms(*plugins: str, kernel: str | None = None, plugin_manager: KernelsPluginManager | None = None,
                    compile: bool = True) -> CheckReport:
    """Fail unless every kernel of ``plugins`` (or only ``kernel``) conforms, as ``kernels-core check`` decides.

    Each kernel runs through its layer kind's conformance cases against the eager modules it replaces: forward,
    backward where declared, every declared dtype, ``torch.compile(fullgraph=True)`` where declared. The
    plugins are the installed ones (entry points) unless ``plugin_manager`` is given. Returns the report, whose
    skipped rows say what could not be checked here (no device of the kernel's backend, ...).

    Example:
        >>> def test_my_plugin_conforms():  # doctest: +SKIP
        ...     assert_conforms("my_plugin")
    """
    report = check(plugins, kernels=(kernel,) if kernel else (), plugin_manager=plugin_manager, compile=compile)
    if report.failures:
        failed = CheckReport(report.failures, report.compile_backend)
        raise AssertionError(f"{report.summary()}\n{failed.table()}")
    return report
