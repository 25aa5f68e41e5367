"""Entry point ``portable``: the core's pure-PyTorch kernels, usable on any device at the lowest priority.

The declarations live in :mod:`kernels_core._portable`; importing this module imports no kernel code.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._hookspecs import hookimpl
from .._types import KernelSpec


__all__ = ["kernels_core_kernels"]


@hookimpl
def kernels_core_kernels() -> Iterable[KernelSpec]:
    from .._portable import SPECS

    return SPECS
