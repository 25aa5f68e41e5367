"""transformers ``Trainer`` (and TRL's trainers, which subclass it): ``KernelizeCallback``.

``Trainer(..., callbacks=[KernelizeCallback()])`` kernelizes the model the Trainer trains when training begins.
Importing this module is cheap: transformers is imported when ``KernelizeCallback`` is first looked up.

Example:
    >>> from kernels_core.integrations.transformers import KernelizeCallback
    >>> KernelizeCallback(strict=True)
    KernelizeCallback(mode=None, config=None, strict=True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any


if TYPE_CHECKING:
    from ._trainer_callback import KernelizeCallback

__all__ = ["KernelizeCallback"]


def __getattr__(name: str) -> Any:
    if name == "KernelizeCallback":
        from ._trainer_callback import KernelizeCallback

        return KernelizeCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
