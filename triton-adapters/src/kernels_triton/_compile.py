"""Whether the caller is being traced by ``torch.compile``.

Dynamo constant-folds :func:`torch.compiler.is_compiling` while tracing, so a branch on it costs nothing at run
time and never breaks the graph.
"""

from __future__ import annotations

import torch


__all__ = ["inference_trace", "tracing"]


def tracing() -> bool:
    """True while Dynamo traces the caller (``torch.compile``), False when running eagerly.

    Example:
        >>> tracing()
        False
    """
    return bool(torch.compiler.is_compiling())


def inference_trace(*tensors: object) -> bool:
    """True while Dynamo traces a call that records no autograd graph (inference under ``torch.compile``).

    There an opaque custom op saves nothing (nothing is saved for backward) and only stops Inductor from fusing
    the op with its neighbours, so adapters hand Inductor the native math instead. Training graphs keep the
    custom ops: they save less for backward than Inductor's decomposition would.

    Example:
        >>> inference_trace(torch.zeros(1))   # eager: never
        False
    """
    if not tracing():
        return False
    return not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors))
