"""Whether the caller is being traced by ``torch.compile``.

Dynamo constant-folds :func:`torch.compiler.is_compiling` while tracing, so a branch on it costs nothing at run
time and never breaks the graph.
"""

from __future__ import annotations


__all__ = ["tracing"]


def tracing() -> bool:
    """True while Dynamo traces the caller (``torch.compile``), False when running eagerly.

    Example:
        >>> tracing()
        False
    """
    import torch

    return bool(torch.compiler.is_compiling())
