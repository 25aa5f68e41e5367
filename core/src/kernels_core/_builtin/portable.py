"""Entry point ``portable``: the core's pure-PyTorch kernels, usable on any device at the lowest priority.

The declarations live in :mod:`kernels_core._portable`; importing this module imports no kernel code.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._plugins._hookspec import PLUGIN_API_VERSION
from .._plugins._hookspec import hookimpl
from .._types import KernelSpec


__all__ = ["KERNELS_CORE_PLUGIN_API", "kernels_core_kernels"]

KERNELS_CORE_PLUGIN_API = PLUGIN_API_VERSION


@hookimpl
def kernels_core_kernels() -> Iterable[KernelSpec]:
    from .._portable import SPECS

    return SPECS
