"""The kernels this plugin declares, with priorities chosen from measurements on an H200 and an H100.

Order of preference among CUDA kernels (higher wins where a kernel qualifies for the mode): ``tuned`` (RMSNorm and
the residual add + RMSNorm: a per-call choice between the Triton kernel and the native ops) 120 > ``triton``
(kernels-triton's own kernels: one launch, thin host side) 115 > ``liger`` 110 > ``torch`` (ATen / Inductor) 100;
MoE experts take kernels-triton's grouped-product experts (118: no autotuning, compile-ready) over Liger's.
The numbers behind this order are in ``benchmarks/results/*.json`` and the plugin README.
Under ``Mode.TORCH_COMPILE`` only kernels declaring it qualify, and the same order then picks: ``tuned`` RMSNorm
(which hands Inductor the native math to fuse with the residual adds), the ``tuned`` residual add + RMSNorm (the
fused Triton kernel as a custom op in training graphs, native math for inference), kernels-triton's RoPE and gated
MLP (traced as opaque ``torch.library`` custom ops) and Liger's fused linear cross-entropy (a custom op that never
materialises the logits). Measured against the alternatives: see ``kernels_cuda._ops``.
"""

from __future__ import annotations

from kernels_core.plugin import CapabilityRange
from kernels_core.plugin import KernelSpec
from kernels_core.plugin import Mode
from kernels_core.plugin import Supports
from kernels_triton import liger_kernel_specs
from kernels_triton import native_kernel_specs
from kernels_triton import triton_kernel_specs

from ._detect import BACKEND
from ._float8_specs import float8_kernel_specs


__all__ = ["cuda_kernel_specs"]

# Liger's CI and bfloat16 Triton code target Ampere and newer; this plugin is verified on Hopper (sm_90). Our own
# Triton kernels use the same bfloat16 loads and stores, so they share the constraint.
TRITON_CAPABILITY = CapabilityRange(min=(8, 0))

PRIORITY_TUNED = 120
PRIORITY_GROUPED_MM = 118
PRIORITY_TRITON = 115
PRIORITY_LIGER = 110
PRIORITY_NATIVE = 100


def cuda_kernel_specs() -> tuple[KernelSpec, ...]:
    """All CUDA kernel declarations.

    Example:
        >>> specs = cuda_kernel_specs()
        >>> max((s for s in specs if s.kind == "rms_norm"), key=lambda s: s.priority).id
        'cuda.rms_norm.tuned'
    """
    tuned = KernelSpec(
        id=f"{BACKEND}.rms_norm.tuned",
        kind="rms_norm",
        variants=("standard", "offset"),
        backend=BACKEND,
        impl="kernels_cuda._ops:rms_norm",
        priority=PRIORITY_TUNED,
        supports=Supports.BACKWARD | Supports.TORCH_COMPILE,
        capability=TRITON_CAPABILITY,
        description="F.rms_norm below a measured size, the Triton RMSNorm above it; under compile, Inductor's fusion",
        native_when_compiled=Mode.INFERENCE | Mode.TORCH_COMPILE,
    )
    tuned_residual = KernelSpec(
        id=f"{BACKEND}.residual_rms_norm.tuned",
        kind="residual_rms_norm",
        variants=("standard", "offset"),
        backend=BACKEND,
        impl="kernels_cuda._ops:residual_rms_norm",
        priority=PRIORITY_TUNED,
        supports=Supports.BACKWARD | Supports.TORCH_COMPILE,
        capability=TRITON_CAPABILITY,
        description="the native add + F.rms_norm below a measured size, the fused Triton kernel above it",
        native_when_compiled=Mode.INFERENCE | Mode.TORCH_COMPILE,
    )
    experts = tuple(
        KernelSpec(
            id=f"{BACKEND}.moe_experts.grouped_mm_{name}",
            kind="moe_experts",
            variants=(variant,),
            backend=BACKEND,
            impl=f"kernels_triton.ops:moe_experts_{variant}",
            priority=PRIORITY_GROUPED_MM,
            supports=Supports.BACKWARD | Supports.TORCH_COMPILE,
            capability=TRITON_CAPABILITY,
            description=f"{name} experts as two torch._grouped_mm products, routing sorted on the device (no host "
                        "sync, nothing autotuned; custom ops under compile for float16/float32)",
        )
        for name, variant in (("silu", "silu"), ("gelu", "gelu_tanh"))
    )
    return (
        tuned,
        tuned_residual,
        *experts,
        *triton_kernel_specs(BACKEND, priority=PRIORITY_TRITON, capability=TRITON_CAPABILITY),
        *liger_kernel_specs(BACKEND, priority=PRIORITY_LIGER, capability=TRITON_CAPABILITY),
        *native_kernel_specs(BACKEND, priority=PRIORITY_NATIVE),
        # Opt-in (the linear kind): used only where configuration names them.
        *float8_kernel_specs(BACKEND),
    )
