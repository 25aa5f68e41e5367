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

from kernels_core.plugin import CapabilityRange
from kernels_core.plugin import KernelSpec
from kernels_core.plugin import Mode
from kernels_core.plugin import Supports


__all__ = ["LIGER_REQUIREMENT", "AdapterEntry", "LIGER_ADAPTERS", "NATIVE_ADAPTERS", "TRITON_ADAPTERS",
           "adapter_kernel_specs", "liger_kernel_specs", "native_kernel_specs", "triton_kernel_specs"]

LIGER_REQUIREMENT = "liger-kernel>=0.8.5"
_ALL_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class AdapterEntry:
    """One shared adapter: the layer kind and variants it implements and where its function lives (``impl``, a
    ``kernels_triton.ops:<name>`` reference: declarations name public paths only)."""

    kind: str
    variants: tuple[str, ...]
    impl: str
    supports: Supports
    description: str
    dtypes: tuple[str, ...] = _ALL_DTYPES


def _by_kind(*entries: AdapterEntry) -> Mapping[str, AdapterEntry]:
    return {entry.kind: entry for entry in entries}


_GRAD = Supports.BACKWARD
_COMPILE = Supports.BACKWARD | Supports.TORCH_COMPILE
_NORM, _GATED, _ROPE = ("standard", "offset"), ("split", "fused"), ("full", "partial")

# Liger's elementwise and norm kernels are declared without TORCH_COMPILE on purpose: under torch.compile the
# native entries below win, since Inductor fuses them with their neighbours (and never autotunes Liger's
# kernels, which crashed Liger + torch.compile with an illegal memory access). The adapters still trace without
# graph breaks if a model kernelized for eager is compiled afterwards: they defer to the native math then.
LIGER_ADAPTERS: Mapping[str, AdapterEntry] = _by_kind(
    AdapterEntry("rms_norm", _NORM, "kernels_triton.ops:liger_rms_norm", _GRAD,
                 "Liger Triton RMSNorm (llama/gemma casting, in_place=False)"),
    AdapterEntry("silu_gated_mlp", _GATED, "kernels_triton.ops:liger_silu_mul", _GRAD,
                 "Liger fused SiLU(gate) * up"),
    AdapterEntry("gelu_gated_mlp", _GATED, "kernels_triton.ops:liger_gelu_tanh_mul", _GRAD,
                 "Liger fused GELU-tanh(gate) * up"),
    AdapterEntry("rotary_embedding", _ROPE, "kernels_triton.ops:liger_rotary_embedding", _GRAD,
                 "Liger Triton RoPE (inputs never modified)"),
    AdapterEntry("causal_lm_loss", ("standard", "softcap", "scaled"),
                 "kernels_triton.ops:liger_fused_linear_cross_entropy",
                 _COMPILE, "Liger fused linear cross-entropy as a torch.library custom op (no [N, V] logits)"),
    AdapterEntry("layer_norm", ("bias",), "kernels_triton.ops:liger_layer_norm", _GRAD, "Liger Triton LayerNorm"),
    AdapterEntry("moe_experts", ("silu",), "kernels_triton.ops:liger_moe_experts_silu", _GRAD,
                 "Liger fused grouped-GEMM MoE experts (SwiGLU)"),
)

# This package's own Triton kernels (one module per op): one launch per direction and a thin Python side, for
# the memory-bound kinds where Liger's host-side costs dominate at transformer sizes (the residual add + RMSNorm
# kernel, a decoder layer's add and post-attention norm in one pass, has no Liger adapter here). Under
# torch.compile they are traced as torch.library custom ops: opaque to Inductor, saving what they save eagerly
# plus one float32 rstd per row.
TRITON_ADAPTERS: Mapping[str, AdapterEntry] = _by_kind(
    AdapterEntry("rms_norm", _NORM, "kernels_triton.ops:rms_norm", _COMPILE,
                 "Triton RMSNorm, one launch per direction (llama/gemma casting; saves only x: the backward "
                 "recomputes rstd)"),
    AdapterEntry("silu_gated_mlp", _GATED, "kernels_triton.ops:silu_mul", _COMPILE,
                 "Triton SiLU(gate) * up, one launch (saves only gate and up)"),
    AdapterEntry("gelu_gated_mlp", _GATED, "kernels_triton.ops:gelu_tanh_mul", _COMPILE,
                 "Triton GELU-tanh(gate) * up, one launch (saves only gate and up)"),
    AdapterEntry("rotary_embedding", _ROPE, "kernels_triton.ops:rotary_embedding", _COMPILE,
                 "Triton RoPE, q and k in one launch (inputs never modified)"),
    AdapterEntry("residual_rms_norm", _NORM, "kernels_triton.ops:residual_rms_norm", _COMPILE,
                 "Triton residual add + RMSNorm, one launch per direction (saves the sum only, the next residual)"),
)

NATIVE_ADAPTERS: Mapping[str, AdapterEntry] = _by_kind(
    AdapterEntry("rms_norm", _NORM, "kernels_triton.ops:native_rms_norm", _COMPILE,
                 "torch.nn.functional.rms_norm eagerly (one fused ATen kernel); the eager ops under torch.compile"),
    AdapterEntry("silu_gated_mlp", _GATED, "kernels_triton.ops:native_silu_mul", _COMPILE,
                 "ATen silu(gate) * up (Inductor fuses it under torch.compile)"),
    AdapterEntry("gelu_gated_mlp", _GATED, "kernels_triton.ops:native_gelu_tanh_mul", _COMPILE,
                 "ATen gelu-tanh(gate) * up (Inductor fuses it)"),
    AdapterEntry("rotary_embedding", _ROPE, "kernels_triton.ops:native_rotary_embedding", _COMPILE,
                 "ATen RoPE math (Inductor fuses it)"),
    AdapterEntry("layer_norm", ("bias", "no_bias"), "kernels_triton.ops:native_layer_norm", _COMPILE,
                 "torch.nn.functional.layer_norm"),
    AdapterEntry("residual_rms_norm", _NORM, "kernels_triton.ops:native_residual_rms_norm", _COMPILE,
                 "ATen add, then the native RMSNorm eagerly; under torch.compile Inductor fuses the add into the "
                 "norm"),
    # Half precision only: FlashAttention's kernel takes nothing else (float32 modules keep the portable kernel).
    AdapterEntry("packed_attention", ("causal", "sliding_window"), "kernels_triton.ops:native_varlen_attention",
                 _GRAD, "FlashAttention's variable-length kernel (ATen's, as torch.nn.attention.varlen_attn calls it) "
                 "over every document of a packed row in one launch", dtypes=("float16", "bfloat16")),
)


# Per family: its adapters, the distributions it requires, and the modes in which it traces to plain PyTorch
# ops. Traced for inference, the Triton and native adapters hand Inductor the native math (kernels_triton._compile),
# so kernelize leaves their modules to torch.compile there; training graphs keep the Triton custom ops. Liger's
# adapters are not declared compile-safe at all.
_FAMILIES: Mapping[str, tuple[Mapping[str, AdapterEntry], tuple[str, ...], Mode]] = {
    "triton": (TRITON_ADAPTERS, (), Mode.INFERENCE | Mode.TORCH_COMPILE),
    "liger": (LIGER_ADAPTERS, (LIGER_REQUIREMENT,), Mode(0)),
    "torch": (NATIVE_ADAPTERS, (), Mode.INFERENCE | Mode.TORCH_COMPILE),
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
    table, requires, native_when_compiled = _FAMILIES[family]
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
            # An adapter that does not support torch.compile (packed_attention) is never chosen under it, so it has
            # no compiled graph to leave to Inductor; KernelSpec refuses the flag without Supports.TORCH_COMPILE.
            native_when_compiled=native_when_compiled if Supports.TORCH_COMPILE in entry.supports else Mode(0),
        )
        for key, entry in table.items()
        if key not in exclude
    )


# The three families by name, for declarations that read as what they are.
liger_kernel_specs = functools.partial(adapter_kernel_specs, "liger")
triton_kernel_specs = functools.partial(adapter_kernel_specs, "triton")
native_kernel_specs = functools.partial(adapter_kernel_specs, "torch")
