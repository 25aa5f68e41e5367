"""AMD GPU architectures (gfx names) and how far Liger's Triton kernels are known to work on each.

ROCm devices are told apart by their gfx name (``gcnArchName`` without feature flags), not by a CUDA-style
``(major, minor)`` capability: HIP's emulated capability maps several ISAs onto one number (gfx906, gfx908 and
gfx90a all report 9.0), so kernel constraints on this backend are ``KernelSpec.archs`` tuples built from the
families below.

What is known and what is assumed (nothing here was run on AMD hardware by this project):

- **Known (gfx942).** Liger-Kernel's AMD CI (``.github/workflows/amd-ci.yml``) runs its unit and convergence tests
  on an MI300 runner (``linux-mi300-gpu-1``); those tests include RMSNorm, LayerNorm, SwiGLU, GeGLU, RoPE, fused
  linear cross-entropy and the fused MoE (``test/transformers/test_fused_moe.py`` has no HIP skip).
- **Assumed (gfx90a, gfx950).** Same CDNA wave64 design and 1024-thread workgroup limit as gfx942. The one AMD
  failure class reported against Liger, ``num_warps=32`` exceeding 1024 threads (Liger #231, on MI250X = gfx90a),
  is handled by Liger for every HIP device (``calculate_settings`` caps ``num_warps`` at 16 when
  ``torch.version.hip`` is set), and gfx950 reports the same wave size and workgroup limit (unsloth #4051).
  Neither is in Liger's CI.
- **Assumed, row-wise kernels only (RDNA3 gfx1100-gfx1102, RDNA4 gfx1200/gfx1201).** Wave32 consumer and
  workstation GPUs that ROCm's PyTorch wheels and Triton's AMD backend target. Liger's norm, gated-activation,
  RoPE and cross-entropy kernels are row-wise loads and reductions without ``tl.dot``; 16 wave32 warps stay well
  inside the workgroup limit. The fused MoE is left out there: it is a Triton grouped GEMM (``tl.dot``,
  autotuned), and Triton #10808 reports fused-MoE Triton kernels faulting on gfx1100.
- **Not claimed:** anything else (gfx906/gfx908, RDNA2 gfx103x, RDNA3.5 gfx115x, gfx1250...). Their modules use
  the PyTorch-native kernels of this plugin or the core's portable kernels.

Example:
    >>> "gfx942" in LIGER_ROW_ARCHS and "gfx942" in LIGER_GEMM_ARCHS
    True
    >>> "gfx1100" in LIGER_GEMM_ARCHS
    False
"""

from __future__ import annotations


__all__ = [
    "CDNA",
    "CDNA2",
    "CDNA3",
    "CDNA4",
    "LIGER_CI_ARCHS",
    "LIGER_GEMM_ARCHS",
    "LIGER_ROW_ARCHS",
    "RDNA",
    "RDNA3",
    "RDNA4",
]

CDNA2 = ("gfx90a",)  # MI210, MI250, MI250X
CDNA3 = ("gfx942",)  # MI300X, MI300A, MI325X
CDNA4 = ("gfx950",)  # MI350X, MI355X
RDNA3 = ("gfx1100", "gfx1101", "gfx1102")  # Radeon RX 7900/7800/7700/7600, PRO W7900/W7800
RDNA4 = ("gfx1200", "gfx1201")  # Radeon RX 9060/9070, AI PRO R9700

CDNA = CDNA2 + CDNA3 + CDNA4
RDNA = RDNA3 + RDNA4

# Where Liger's own AMD CI runs its tests.
LIGER_CI_ARCHS = CDNA3
# Row-wise Liger kernels (norms, gated activations, RoPE, cross-entropy): CDNA known/assumed, RDNA assumed.
LIGER_ROW_ARCHS = CDNA + RDNA
# Liger kernels built on Triton matrix multiplies (fused MoE grouped GEMM): CDNA only.
LIGER_GEMM_ARCHS = CDNA
