"""What every matcher needs: the original forward of a module, probe inputs and tolerances.

Probes run the module's *original* forward (the class forward, or what kernels-core replaced) on a few random
rows under ``torch.no_grad()``, on the module's own device and dtype, with its real parameters. They never
change the module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


__all__ = [
    "MatchContext",
    "math_key",
    "close",
    "module_device",
    "param_dtype",
    "plain_class_forward",
    "positional_arity",
    "rel_error",
    "tolerance",
]

BINDING_ATTR = "_kernels_core_binding"

# Relative error (max |a-b| / max |b|) below which a probe counts as the same math. Generous enough for the
# module computing in a different order than the reference, tight enough that a (1 + w) offset, a different
# activation or a missing multiplier (errors of order 1) never passes.
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def tolerance(dtype: torch.dtype) -> float:
    return _TOLERANCE.get(dtype, 3e-2)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual - expected).abs().max() / scale)


def close(actual: object, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        isinstance(actual, torch.Tensor)
        and actual.shape == expected.shape
        and bool(torch.isfinite(actual).all())
        and rel_error(actual, expected) <= tolerance(dtype)
    )


def module_device(module: nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


def param_dtype(module: nn.Module) -> torch.dtype | None:
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def plain_class_forward(module: nn.Module) -> Callable[..., Any]:
    """The class's forward with decorators peeled off (for reading its code, not for calling)."""
    return inspect.unwrap(type(module).forward)


def positional_arity(fn: Callable[..., Any]) -> tuple[int, bool]:
    """(number of positional parameters after self, whether it takes *args) of a class forward."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional), any(p.kind is p.VAR_POSITIONAL for p in params)


_SCALARS = (bool, int, float, str, type(None))


def _scalars(module: nn.Module) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(
        (name, value) for name, value in vars(module).items()
        if isinstance(value, _SCALARS) and not name.startswith("_") and name != "training"
    ))


def math_key(module: nn.Module) -> tuple[object, ...]:
    """Identity of a module's math up to weight values (see :meth:`MatchContext.verdict`)."""
    parts: list[object] = []
    for name, child in module.named_modules():
        override = child.__dict__.get("forward")
        record = child.__dict__.get(BINDING_ATTR)
        if record is not None:  # our own binding: the math is that of what it replaced
            previous = record.previous.get("forward", record.MISSING)
            override = None if previous is record.MISSING else previous
        parts.append((name, type(child), _scalars(child), None if override is None else id(override)))
    for name, param in module.named_parameters():
        parts.append((name, tuple(param.shape), param.dtype, param.device))
    for name, buffer in module.named_buffers():
        parts.append((name, tuple(buffer.shape), buffer.dtype, buffer.device))
    return tuple(parts)


class MatchContext:
    """Per-kernelize-call state shared by matchers.

    Args:
        root: the model being kernelized.
        seed: seed for probe inputs, so classification is reproducible.
    """

    def __init__(self, root: nn.Module, *, seed: int = 1234) -> None:
        self.root = root
        self.config = getattr(root, "config", None)
        self._seed = seed
        self._rotary_dims: set[int] | None = None
        self.memo: dict[tuple[object, ...], Any] = {}

    def original_forward(self, module: nn.Module) -> Callable[..., Any]:
        """The forward the module had before kernels-core bound anything to it."""
        record = module.__dict__.get(BINDING_ATTR)
        if record is not None and "forward" in record.previous:
            previous = record.previous["forward"]
            if previous is not record.MISSING:
                return previous
            return type(module).forward.__get__(module, type(module))
        return module.forward

    def run_probe(self, module: nn.Module, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(*args)`` with the module in eval and in training behaviour (dropout and the like show up).

        A kernel replaces the forward in both modes, so both must compute the reference math.
        """
        flags = [(m, m.training) for m in module.modules()]
        outputs = []
        try:
            with torch.no_grad():
                for training in (False, True):
                    for m, _ in flags:
                        m.training = training
                    outputs.append(fn(*args))
        finally:
            for m, was_training in flags:
                m.training = was_training
        return outputs

    def verdict(self, kind: str, module: nn.Module, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per distinct piece of math: layers sharing a math key share the probe's verdict.

        The key holds everything the math can depend on besides the weight values: the classes, the scalar
        hyperparameters of the module and its children (epsilon, head_dim, activation settings...), parameter
        shapes, dtypes and devices, and any instance-level forward override. A 28-layer model is probed once
        per kind instead of 28 times.
        """
        key = (kind, math_key(module))
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device) if device.type in ("cpu", "cuda") else torch.Generator()
        gen.manual_seed(self._seed)
        return gen

    def randn(self, *shape: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
        on = device if gen.device.type == device.type else torch.device("cpu")
        return torch.randn(*shape, generator=gen, device=on, dtype=torch.float32).to(device=device, dtype=dtype)

    def rotary_dims(self) -> set[int]:
        """Dimensions rotated by the model's rotary embedding modules (2 * len(inv_freq))."""
        if self._rotary_dims is None:
            dims: set[int] = set()
            for module in self.root.modules():
                # "inv_freq", or one per attention type ("sliding_attention_inv_freq" in Gemma 3).
                for name, buffer in module._buffers.items():
                    if name.endswith("inv_freq") and isinstance(buffer, torch.Tensor) and buffer.dim() == 1:
                        dims.add(2 * buffer.numel())
            self._rotary_dims = dims
        return self._rotary_dims
