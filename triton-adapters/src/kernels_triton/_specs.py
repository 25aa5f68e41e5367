"""Kernel declarations for the shared adapters, built per backend.

Both GPU plugins wrap the same Liger operations and this package's own Triton kernels; what differs between
them is the backend name, the hardware constraints and the priorities. They therefore call
:func:`adapter_kernel_specs` (or its per-family names ``triton_kernel_specs``, ``liger_kernel_specs``,
``native_kernel_specs``) with their own values instead of copying declarations. Nothing here imports torch,
Triton or Liger.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from collections.abc import Mapping
from dataclasses import dataclass

from kernels_core import CapabilityRange
from kernels_core import KernelSpec
from kernels_core import Supports


__all__ = ["LIGER_REQUIREMENT", "AdapterEntry", "LIGER_ADAPTERS", "NATIVE_ADAPTERS", "TRITON_ADAPTERS",
           "adapter_kernel_specs", "liger_kernel_specs", "native_kernel_specs", "triton_kernel_specs"]

LIGER_REQUIREMENT = "liger-kernel>=0.8.5"
_ALL_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class AdapterEntry:
    """One shared adapter: the layer kind and variants it implements and where its function lives."""

    kind: str
    variants: tuple[str, ...]
    impl: str
    supports: Supports
    description: str
    dtypes: tuple[str, ...] = _ALL_DTYPES


_PKG = "kernels_triton"

# Liger's elementwise and norm kernels are declared without TORCH_COMPILE on purpose: under torch.compile the
# native entries below win, since Inductor fuses them with their neighbours (and never autotunes Liger's
# kernels, which crashed Liger + torch.compile with an illegal memory access). The adapters still trace without
# graph breaks if a model kernelized for eager is compiled afterwards: they defer to the native math then.
LIGER_ADAPTERS: Mapping[str, AdapterEntry] = {
    "rms_norm": AdapterEntry(
        "rms_norm", ("standard", "offset"), f"{_PKG}._rms_norm:liger_rms_norm", Supports.BACKWARD,
        "Liger Triton RMSNorm (llama/gemma casting, in_place=False)",
    ),
    "silu_gated_mlp": AdapterEntry(
        "silu_gated_mlp", ("split", "fused"), f"{_PKG}._gated:liger_silu_mul", Supports.BACKWARD,
        "Liger fused SiLU(gate) * up",
    ),
    "gelu_gated_mlp": AdapterEntry(
        "gelu_gated_mlp", ("split", "fused"), f"{_PKG}._gated:liger_gelu_tanh_mul", Supports.BACKWARD,
        "Liger fused GELU-tanh(gate) * up",
    ),
    "rotary_embedding": AdapterEntry(
        "rotary_embedding", ("full", "partial"), f"{_PKG}._rotary:liger_rotary_embedding", Supports.BACKWARD,
        "Liger Triton RoPE (inputs never modified)",
    ),
    "causal_lm_loss": AdapterEntry(
        "causal_lm_loss", ("standard", "softcap"), f"{_PKG}._loss:fused_linear_cross_entropy",
        Supports.BACKWARD | Supports.TORCH_COMPILE,
        "Liger fused linear cross-entropy as a torch.library custom op (no [N, V] logits)",
    ),
    "layer_norm": AdapterEntry(
        "layer_norm", ("bias",), f"{_PKG}._layer_norm:layer_norm", Supports.BACKWARD, "Liger Triton LayerNorm",
    ),
    "moe_experts": AdapterEntry(
        "moe_experts", ("silu",), f"{_PKG}._moe:moe_experts_silu", Supports.BACKWARD,
        "Liger fused grouped-GEMM MoE experts (SwiGLU)",
    ),
}

# This package's own Triton kernels (one module per op): one launch per direction and a thin Python side, for
# the memory-bound kinds where Liger's host-side costs dominate at transformer sizes (the residual add + RMSNorm
# kernel, a decoder layer's add and post-attention norm in one pass, has no Liger adapter here). Under
# torch.compile they are traced as torch.library custom ops: opaque to Inductor, saving what they save eagerly
# plus one float32 rstd per row.
_TRITON = Supports.BACKWARD | Supports.TORCH_COMPILE
TRITON_ADAPTERS: Mapping[str, AdapterEntry] = {
    "rms_norm": AdapterEntry(
        "rms_norm", ("standard", "offset"), f"{_PKG}._rms_norm:rms_norm", _TRITON,
        "Triton RMSNorm, one launch per direction (llama/gemma casting; saves only x: the backward recomputes rstd)",
    ),
    "silu_gated_mlp": AdapterEntry(
        "silu_gated_mlp", ("split", "fused"), f"{_PKG}._gated:silu_mul", _TRITON,
        "Triton SiLU(gate) * up, one launch (saves only gate and up)",
    ),
    "gelu_gated_mlp": AdapterEntry(
        "gelu_gated_mlp", ("split", "fused"), f"{_PKG}._gated:gelu_tanh_mul", _TRITON,
        "Triton GELU-tanh(gate) * up, one launch (saves only gate and up)",
    ),
    "rotary_embedding": AdapterEntry(
        "rotary_embedding", ("full", "partial"), f"{_PKG}._rotary:rotary_embedding", _TRITON,
        "Triton RoPE, q and k in one launch (inputs never modified)",
    ),
    "residual_rms_norm": AdapterEntry(
        "residual_rms_norm", ("standard", "offset"), f"{_PKG}._residual_rms_norm:residual_rms_norm", _TRITON,
        "Triton residual add + RMSNorm, one launch per direction (saves the sum only, the next residual)",
    ),
}

NATIVE_ADAPTERS: Mapping[str, AdapterEntry] = {
    "rms_norm": AdapterEntry(
        "rms_norm", ("standard", "offset"), f"{_PKG}._native:rms_norm", Supports.BACKWARD | Supports.TORCH_COMPILE,
        "torch.nn.functional.rms_norm eagerly (one fused ATen kernel); the eager ops under torch.compile",
    ),
    "silu_gated_mlp": AdapterEntry(
        "silu_gated_mlp", ("split", "fused"), f"{_PKG}._native:silu_mul", Supports.BACKWARD | Supports.TORCH_COMPILE,
        "ATen silu(gate) * up (Inductor fuses it under torch.compile)",
    ),
    "gelu_gated_mlp": AdapterEntry(
        "gelu_gated_mlp", ("split", "fused"), f"{_PKG}._native:gelu_tanh_mul",
        Supports.BACKWARD | Supports.TORCH_COMPILE, "ATen gelu-tanh(gate) * up (Inductor fuses it)",
    ),
    "rotary_embedding": AdapterEntry(
        "rotary_embedding", ("full", "partial"), f"{_PKG}._native:rotary_embedding",
        Supports.BACKWARD | Supports.TORCH_COMPILE, "ATen RoPE math (Inductor fuses it)",
    ),
    "layer_norm": AdapterEntry(
        "layer_norm", ("bias", "no_bias"), f"{_PKG}._native:layer_norm", Supports.BACKWARD | Supports.TORCH_COMPILE,
        "torch.nn.functional.layer_norm",
    ),
    "residual_rms_norm": AdapterEntry(
        "residual_rms_norm", ("standard", "offset"), f"{_PKG}._native:residual_rms_norm",
        Supports.BACKWARD | Supports.TORCH_COMPILE,
        "ATen add, then the native RMSNorm eagerly; under torch.compile Inductor fuses the add into the norm",
    ),
}


_FAMILIES: Mapping[str, tuple[Mapping[str, AdapterEntry], tuple[str, ...]]] = {
    "triton": (TRITON_ADAPTERS, ()),
    "liger": (LIGER_ADAPTERS, (LIGER_REQUIREMENT,)),
    "torch": (NATIVE_ADAPTERS, ()),
}


def adapter_kernel_specs(
    family: str,
    backend: str,
    *,
    priority: int = 100,
    priorities: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
    capability: CapabilityRange | None = None,
    archs: tuple[str, ...] = (),
) -> tuple[KernelSpec, ...]:
    """Declarations of one family of shared adapters for one backend, ids ``<backend>.<kind>.<family>``.

    ``family`` is ``"triton"`` (this package's own Triton kernels: they need no distribution beyond Triton itself,
    which ships with torch's GPU builds under different names, so a host without it fails the kernel's import and
    kernelize falls back), ``"liger"`` (requires liger-kernel) or ``"torch"`` (PyTorch-native). ``priorities``
    overrides ``priority`` per layer kind; ``exclude`` leaves kinds out.

    Example:
        >>> specs = adapter_kernel_specs("liger", "rocm", priority=100, priorities={"rms_norm": 90},
        ...                              archs=("gfx942",))
        >>> next(s for s in specs if s.kind == "rms_norm").priority
        90
        >>> sorted(s.id for s in adapter_kernel_specs("triton", "cuda"))[:3]
        ['cuda.gelu_gated_mlp.triton', 'cuda.residual_rms_norm.triton', 'cuda.rms_norm.triton']
    """
    if family not in _FAMILIES:
        raise ValueError(f"unknown adapter family {family!r}; expected one of {sorted(_FAMILIES)}")
    table, requires = _FAMILIES[family]
    unknown = (set(priorities or {}) | set(exclude)) - set(table)
    if unknown:
        raise ValueError(f"unknown layer kinds {sorted(unknown)} for the {family!r} adapters; they cover: "
                         f"{sorted(table)}")
    return tuple(
        KernelSpec(
            id=f"{backend}.{key}.{family}",
            kind=entry.kind,
            variants=entry.variants,
            backend=backend,
            impl=entry.impl,
            priority=(priorities or {}).get(key, priority),
            supports=entry.supports,
            dtypes=entry.dtypes,
            capability=capability,
            archs=archs,
            requires=requires,
            description=entry.description,
        )
        for key, entry in table.items()
        if key not in exclude
    )


# The three families by name, for declarations that read as what they are.
liger_kernel_specs = functools.partial(adapter_kernel_specs, "liger")
triton_kernel_specs = functools.partial(adapter_kernel_specs, "triton")
native_kernel_specs = functools.partial(adapter_kernel_specs, "torch")
