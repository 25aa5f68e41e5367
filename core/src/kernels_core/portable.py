"""The core's portable PyTorch kernels, for plugins that need a device-independent fallback.

Each follows its layer kind's calling convention (``docs/kernel-conventions.md``), so a vendor adapter can hand
over inputs it cannot serve (CPU tensors, unsupported dtypes) without changing the math.

Example:
    >>> import torch
    >>> from kernels_core.portable import fused_linear_cross_entropy
    >>> loss = fused_linear_cross_entropy(torch.randn(5, 8), torch.randn(11, 8), torch.tensor([1, 2, -100, 4, 5]))
    >>> loss.dtype
    torch.float32
"""

from ._portable._cross_entropy import fused_linear_cross_entropy
from ._portable._packed_attention import document_bounds
from ._portable._packed_attention import equal_documents
from ._portable._packed_attention import packed_attention
from ._portable._residual_rms_norm import residual_rms_norm
from ._portable._rms_norm import rms_norm
from ._portable._silu_mul import silu_mul


__all__ = ["document_bounds", "equal_documents", "fused_linear_cross_entropy", "packed_attention",
           "residual_rms_norm", "rms_norm", "silu_mul"]
