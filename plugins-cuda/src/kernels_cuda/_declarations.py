"""The kernels this plugin declares, with priorities chosen from measurements on an H100.

Order of preference among CUDA kernels (higher wins where a kernel qualifies for the mode):
``tuned`` (per-call choice between Liger and ATen) 120 > ``liger`` 110 > ``torch`` (ATen / Inductor) 100.
Under ``Mode.TORCH_COMPILE`` only kernels declaring it qualify: the ``torch`` entries (Inductor fuses them) and
Liger's fused linear cross-entropy (an opaque custom op that avoids materialising the logits).
"""

from __future__ import annotations

from kernels_core import CapabilityRange
from kernels_core import KernelSpec
from kernels_core import Supports
from kernels_triton import LIGER_REQUIREMENT
from kernels_triton import liger_kernel_specs
from kernels_triton import native_kernel_specs

from ._detect import BACKEND


__all__ = ["cuda_kernel_specs"]

# Liger's CI and bfloat16 Triton code target Ampere and newer; this plugin is verified on Hopper (sm_90).
LIGER_CAPABILITY = CapabilityRange(min=(8, 0))

PRIORITY_TUNED = 120
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
        supports=Supports.BACKWARD,
        capability=LIGER_CAPABILITY,
        requires=(LIGER_REQUIREMENT,),
        description="F.rms_norm below a measured size, Liger RMSNorm above it",
    )
    return (
        tuned,
        *liger_kernel_specs(BACKEND, priority=PRIORITY_LIGER, capability=LIGER_CAPABILITY),
        *native_kernel_specs(BACKEND, priority=PRIORITY_NATIVE),
    )
