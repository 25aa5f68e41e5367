"""Plugins with deliberately wrong kernels, for the conformance check's tests (``test_check.py``)."""

from __future__ import annotations

import torch
from kernels_core import KernelSpec
from kernels_core import LayerKind
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import reference


_M = "conformance_plugins"
_ALL = Supports.BACKWARD | Supports.TORCH_COMPILE


def rms_norm_scaled(x, weight, *, eps, offset, casting):
    """Off by a factor of 1.5."""
    return reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting) * 1.5


class _WrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return grad * up, grad * torch.nn.functional.silu(gate)  # forgets silu's derivative


def silu_mul_wrong_backward(gate, up):
    return _WrongBackward.apply(gate, up)


def rms_norm_float32(x, weight, *, eps, offset, casting):
    """Right values, wrong dtype: always float32."""
    return reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting).float()


def silu_mul_graph_break(gate, up):
    """Right math, but ``print`` breaks the graph under ``torch.compile``."""
    print("", end="")
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate, up):
    return torch.nn.functional.silu(gate) * up


def no_conformance_impl(x):
    return x


class Wrong:
    """Every kernel here is wrong in one way."""

    @hookimpl
    def kernels_core_kernels(self):
        return [
            KernelSpec(id="bad.rms_norm.scaled", kind="rms_norm", variants=("standard",), backend="any", priority=1,
                       impl=f"{_M}:rms_norm_scaled", supports=Supports.BACKWARD, dtypes=("float32",)),
            KernelSpec(id="bad.silu.backward", kind="silu_gated_mlp", variants=("split",), backend="any", priority=1,
                       impl=f"{_M}:silu_mul_wrong_backward", supports=Supports.BACKWARD, dtypes=("float32",)),
            KernelSpec(id="bad.rms_norm.dtype", kind="rms_norm", variants=("standard",), backend="any", priority=2,
                       impl=f"{_M}:rms_norm_float32", supports=Supports.BACKWARD, dtypes=("bfloat16",)),
            KernelSpec(id="bad.silu.compile", kind="silu_gated_mlp", variants=("split",), backend="any", priority=2,
                       impl=f"{_M}:silu_mul_graph_break", supports=_ALL, dtypes=("float32",)),
            KernelSpec(id="bad.silu.missing", kind="silu_gated_mlp", variants=("split",), backend="any", priority=4,
                       impl=f"{_M}:does_not_exist", supports=Supports.BACKWARD, dtypes=("float32",)),
        ]


class Elsewhere:
    """A right kernel for a backend no plugin detects, an inference-only one, and a kind without conformance."""

    @hookimpl
    def kernels_core_layer_kinds(self):
        return [LayerKind(name="opaque", description="a kind without conformance cases", variants=("one",),
                          matcher=f"{_M}:no_conformance_impl", adapter=f"{_M}:no_conformance_impl"),
                LayerKind(name="broken_cases", description="a kind whose conformance cases raise", variants=("one",),
                          matcher=f"{_M}:no_conformance_impl", adapter=f"{_M}:no_conformance_impl",
                          conformance=f"{_M}:raising_cases")]

    @hookimpl
    def kernels_core_kernels(self):
        return [
            KernelSpec(id="acme.silu.fast", kind="silu_gated_mlp", variants=("split",), backend="acme",
                       impl=f"{_M}:silu_mul", dtypes=("float32",)),
            KernelSpec(id="ok.silu.inference", kind="silu_gated_mlp", variants=("split", "fused"), backend="any",
                       priority=3,
                       impl=f"{_M}:silu_mul", supports=Supports.NONE, dtypes=("float32",)),
            KernelSpec(id="ok.opaque", kind="opaque", variants=("one",), backend="any",
                       impl=f"{_M}:no_conformance_impl"),
            KernelSpec(id="ok.broken_cases", kind="broken_cases", variants=("one",), backend="any",
                       impl=f"{_M}:no_conformance_impl"),
        ]


def raising_cases():
    raise RuntimeError("cases need a GPU")
