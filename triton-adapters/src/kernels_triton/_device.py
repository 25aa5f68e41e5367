"""Launch kernels on the device that holds their inputs.

Triton launches on the *current* device, not on the device of its arguments. With ``device_map`` spreading a
model over several GPUs, a layer on ``cuda:1`` called while ``cuda:0`` is current then reads and writes the
wrong device's memory (Liger and Hugging Face users saw corrupted RMSNorm outputs). Every adapter in this
package enters :func:`on_device_of` around its launches so that this cannot happen through us.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ._compile import tracing


__all__ = ["eager_device_context", "on_device_of"]


_NOTHING_TO_SWITCH = contextlib.nullcontext()


def on_device_of(tensor: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """A context that makes ``tensor``'s device current for the duration of the block.

    ROCm tensors report the device type ``cuda`` as well, so this covers both GPU plugins. With one visible GPU
    there is nothing to switch, and the context costs nothing (this runs once per kernel call).

    Example:
        >>> with on_device_of(torch.zeros(1)):  # CPU tensors: nothing to switch
        ...     pass
    """
    # While Dynamo traces, the kernels are custom ops that enter this context themselves when they run; and
    # device_count() there would break the graph (Dynamo does not trace calls returning plain ints).
    if tensor.device.type == "cuda" and not tracing():
        return eager_device_context(tensor)
    return _NOTHING_TO_SWITCH


def eager_device_context(tensor: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """:func:`on_device_of` for callers that already know they run eagerly (not under Dynamo), on a GPU tensor.

    Example:
        >>> with eager_device_context(torch.zeros(1)):  # one device or none: nothing to switch
        ...     pass
    """
    if _several_gpus():
        return torch.cuda.device(tensor.device)
    return _NOTHING_TO_SWITCH


@functools.cache
def _several_gpus() -> bool:
    # The visible devices are fixed for the process once CUDA is initialised; asked on every kernel call.
    return torch.cuda.device_count() > 1
