"""The kernels this plugin declares for the ``rocm`` backend: kernels-triton's own Triton kernels, the shared Liger
adapters and PyTorch-native ones.

Nothing here copies an adapter. Both GPU plugins get their declarations from kernels-triton's spec builders;
this module only decides what differs on AMD: which gfx architectures each Liger kernel may run on
(:mod:`kernels_rocm._archs`) and which implementation is preferred where both apply.

No kernel here has been timed on AMD hardware, so the priorities follow one rule that does not depend on
timings we do not have: Liger is preferred where it fuses what eager PyTorch runs as several kernels (gated
activations, RoPE, linear + cross-entropy, MoE routing and expert GEMMs), and the native op is preferred where
ATen already has one fused kernel for the whole layer (``F.rms_norm`` and ``F.layer_norm``, whose CUDA kernels
ROCm builds compile through hipify, since ROCm tensors use the CUDA dispatch key). There, a Triton kernel saves
no memory traffic, and on NVIDIA the measurements in issue 4 show Liger's RMSNorm losing to ``F.rms_norm`` below
2**27 elements (H200, bf16 [8192, 1024]: Liger 72.7 us, ``F.rms_norm`` 15.3 us), largely to Python-side launch
work that is no cheaper on ROCm. The Liger norms stay declared, selectable through configuration
(``kinds.rms_norm.prefer.rocm = ["rocm.rms_norm.liger"]``).

kernels-triton's own Triton kernels (RMSNorm, RoPE, gated activations) fuse the same work as Liger's with one
launch and a thinner Python side; on NVIDIA that host-side difference is what made them faster
(``benchmarks/results/*-h200.json``), and host-side Python costs the same whichever GPU follows. They rank
above Liger's where both apply, on the same architectures as Liger's row-wise kernels (no ``tl.dot``); for RMSNorm
``F.rms_norm`` stays first by the rule above and the Triton kernel comes second. The fused residual add + RMSNorm
(``residual_rms_norm``) has no single ATen kernel (eager runs the add, then ``F.rms_norm``), so by the same rule its
Triton kernel comes first and the native pair second; it has not been timed on any GPU yet.

Under ``Mode.TORCH_COMPILE`` only kernels declaring it qualify and the same order picks: ``F.rms_norm``'s native
math for RMSNorm (Inductor fuses it), kernels-triton's RoPE and gated MLP (traced as ``torch.library`` custom ops)
and Liger's fused linear cross-entropy (an opaque custom op), the same choices as on CUDA, where they were
measured fastest under compile; and, as on CUDA, kernels-triton's residual add + RMSNorm as a custom op (not
measured against Inductor's own fusion of the native pair anywhere yet).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from kernels_core.plugin import KernelSpec
from kernels_triton import LIGER_ADAPTERS
from kernels_triton import TRITON_ADAPTERS
from kernels_triton import liger_kernel_specs
from kernels_triton import native_kernel_specs
from kernels_triton import triton_kernel_specs

from ._archs import LIGER_GEMM_ARCHS
from ._archs import LIGER_ROW_ARCHS
from ._detect import BACKEND


__all__ = ["FIRST", "LIGER_ARCHS", "LIGER_PRIORITIES", "NATIVE_EXCLUDED", "NATIVE_PRIORITIES", "PREFERRED", "SECOND",
           "TRITON_ARCHS", "TRITON_PRIORITIES", "rocm_kernel_specs"]

logger = logging.getLogger(__name__)

# Vendor kernels use priorities of 100 and above, so they win over the core's portable kernels (0).
FIRST = 115
PREFERRED = 110
BETWEEN = 105
SECOND = 100

# Per shared Liger adapter: the gfx architectures it is declared for (see _archs for known vs assumed).
# A kind missing here is not declared on ROCm until someone reviews it for AMD.
LIGER_ARCHS: Mapping[str, tuple[str, ...]] = {
    "rms_norm": LIGER_ROW_ARCHS,
    "layer_norm": LIGER_ROW_ARCHS,
    "silu_gated_mlp": LIGER_ROW_ARCHS,
    "gelu_gated_mlp": LIGER_ROW_ARCHS,
    "rotary_embedding": LIGER_ROW_ARCHS,
    # Row-wise Triton cross-entropy over logits chunks that torch.matmul (hipBLASLt) computes.
    "causal_lm_loss": LIGER_ROW_ARCHS,
    # Triton grouped GEMM: CDNA only (fused-MoE Triton kernels fault on gfx1100, Triton #10808).
    "moe_experts": LIGER_GEMM_ARCHS,
}

LIGER_PRIORITIES: Mapping[str, int] = {
    "rms_norm": SECOND,  # one fused ATen kernel exists: F.rms_norm first (module docstring)
    "layer_norm": SECOND,  # likewise F.layer_norm
    "silu_gated_mlp": PREFERRED,  # one kernel instead of silu + mul; saves only gate/up for backward
    "gelu_gated_mlp": PREFERRED,
    "rotary_embedding": PREFERRED,  # one launch for q and k instead of eager's chain of elementwise ops
    "causal_lm_loss": PREFERRED,  # never materialises [tokens, vocab] logits; no native alternative
    "moe_experts": PREFERRED,  # grouped GEMM instead of a Python loop over experts; no native alternative
}

# kernels-triton's own kernels: row-wise loads and reductions like Liger's norms, so the same architectures.
TRITON_ARCHS: Mapping[str, tuple[str, ...]] = {
    "rms_norm": LIGER_ROW_ARCHS,
    "silu_gated_mlp": LIGER_ROW_ARCHS,
    "gelu_gated_mlp": LIGER_ROW_ARCHS,
    "rotary_embedding": LIGER_ROW_ARCHS,
    "residual_rms_norm": LIGER_ROW_ARCHS,
}

TRITON_PRIORITIES: Mapping[str, int] = {
    "rms_norm": BETWEEN,  # after F.rms_norm (one fused ATen kernel), before Liger's
    "silu_gated_mlp": FIRST,  # Liger's fusion with a thinner host side
    "gelu_gated_mlp": FIRST,
    "rotary_embedding": FIRST,
    "residual_rms_norm": FIRST,  # no single ATen kernel does the add and the norm: eager runs two
}

NATIVE_PRIORITIES: Mapping[str, int] = {
    "rms_norm": PREFERRED,
    "layer_norm": PREFERRED,
    "silu_gated_mlp": SECOND,
    "gelu_gated_mlp": SECOND,
    "rotary_embedding": SECOND,
    "residual_rms_norm": SECOND,
}


# PyTorch's variable-length FlashAttention is not verified on ROCm builds: packed rows keep the core's portable
# kernel there (one causal SDPA call per document, which ROCm's own SDPA kernels take).
NATIVE_EXCLUDED: tuple[str, ...] = ("packed_attention",)


def _liger_specs() -> tuple[KernelSpec, ...]:
    unreviewed = sorted(set(LIGER_ADAPTERS) - set(LIGER_ARCHS))
    if unreviewed:
        logger.debug("kernels-rocm: shared Liger adapters %s are not reviewed for AMD; not declared", unreviewed)
    specs = liger_kernel_specs(BACKEND, priority=PREFERRED, priorities=LIGER_PRIORITIES, exclude=unreviewed)
    # The shared builder takes one archs tuple for all kernels; the constraint differs per kernel here.
    return tuple(dataclasses.replace(spec, archs=LIGER_ARCHS[spec.kind]) for spec in specs)


def _triton_specs() -> tuple[KernelSpec, ...]:
    specs = triton_kernel_specs(BACKEND, priority=SECOND, priorities=TRITON_PRIORITIES,
                                exclude=sorted(set(TRITON_ADAPTERS) - set(TRITON_ARCHS)))
    return tuple(dataclasses.replace(spec, archs=TRITON_ARCHS[spec.kind]) for spec in specs)


def rocm_kernel_specs() -> tuple[KernelSpec, ...]:
    """All ROCm kernel declarations: Triton and Liger kernels constrained per gfx architecture, native ones on any.

    Example:
        >>> specs = {s.id: s for s in rocm_kernel_specs()}
        >>> specs["rocm.moe_experts.liger"].archs
        ('gfx90a', 'gfx942', 'gfx950')
        >>> specs["rocm.rms_norm.torch"].priority > specs["rocm.rms_norm.liger"].priority
        True
    """
    native = native_kernel_specs(BACKEND, priority=SECOND, priorities=NATIVE_PRIORITIES, exclude=NATIVE_EXCLUDED)
    return (*_triton_specs(), *_liger_specs(), *native)
