"""Declaring the ``kernels_triton::<name>`` custom ops through which ``torch.compile`` traces this package's kernels.

Each op runs its implementation with its first argument's device current and has a fake (meta) implementation;
a differentiable op's gradient is a second custom op. Eager calls never go through these ops (a custom op's
dispatch costs tens of microseconds of host time per call): each module's ``torch.autograd.Function`` runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._device import on_device_of


__all__ = ["custom_op", "dense_like", "register_backward"]


def custom_op(name: str, *, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: the function as the custom op ``kernels_triton::<name>`` (schema inferred from its type hints),
    run on the device of its first argument, with ``fake`` computing its outputs' metadata while tracing."""

    def define(fn: Callable[..., Any]) -> Any:
        @functools.wraps(fn)  # the schema is inferred through __wrapped__
        def on_device(*args: Any) -> Any:
            with on_device_of(args[0]):
                return fn(*args)

        op = torch.library.custom_op(f"kernels_triton::{name}", on_device, mutates_args=())
        op.register_fake(fake)
        return op

    return define


def register_backward(op: Any, *, save: Callable[[tuple, Any], tuple[tuple, tuple]], grad: Callable[..., tuple],
                      non_differentiable: tuple[int, ...] = ()) -> None:
    """Differentiate ``op``: ``save(inputs, output)`` returns the tensors to save for backward and the other values
    the backward needs, ``grad(saved, *output_grads)`` the inputs' gradients, where ``saved`` is those tensors
    followed by those values. Outputs at the positions ``non_differentiable`` get no gradient.
    """

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        tensors, ctx.values = save(inputs, output)
        ctx.save_for_backward(*tensors)
        if non_differentiable:
            ctx.mark_non_differentiable(*(output[i] for i in non_differentiable))

    op.register_autograd(lambda ctx, *grads: grad((*ctx.saved_tensors, *ctx.values), *grads),
                         setup_context=setup_context)


def dense_like(t: torch.Tensor) -> torch.Tensor:
    """An empty contiguous tensor of ``t``'s shape and dtype: the fake of a kernel output written row-major.

    Example:
        >>> dense_like(torch.zeros(3, 2).t()).stride()
        (3, 1)
    """
    return torch.empty_like(t, memory_format=torch.contiguous_format)
