"""The core's portable kernels: pure PyTorch, any device, lowest priority.

Only declarations live here. Importing this package imports no torch and no kernel module; each ``impl`` is a
lazy ``module:attr`` reference that the core resolves when kernelize picks it. Vendor plugins declare
priorities of 100 and above, so on their hardware they win over these automatically.

Example:
    >>> from kernels_core._portable import SPECS
    >>> sorted({spec.kind for spec in SPECS})  # doctest: +NORMALIZE_WHITESPACE
    ['causal_lm_loss', 'causal_mask', 'packed_attention', 'residual_rms_norm', 'rms_norm', 'silu_gated_mlp',
     'sliding_window_attention']
"""

from __future__ import annotations

from .._types import KernelSpec
from .._types import Mode
from .._types import Supports


__all__ = ["SPECS"]

_ALL_FLOATS = ("float16", "bfloat16", "float32")
_TRAINABLE = Supports.BACKWARD | Supports.TORCH_COMPILE
# Traced with no autograd graph these are the plain PyTorch math: torch.compile gets the module's own forward.
_NATIVE_FOR_COMPILED_INFERENCE = Mode.INFERENCE | Mode.TORCH_COMPILE

SPECS: tuple[KernelSpec, ...] = (
    KernelSpec(
        id="any.causal_lm_loss.chunked",
        kind="causal_lm_loss",
        variants=("standard", "softcap"),
        backend="any",
        impl="kernels_core._portable._cross_entropy:fused_linear_cross_entropy",
        priority=0,
        supports=_TRAINABLE,
        dtypes=_ALL_FLOATS,
        description="chunked fused linear cross-entropy; never materializes [tokens, vocab] logits",
    ),
    KernelSpec(
        id="any.causal_mask.sdpa_is_causal",
        kind="causal_mask",
        variants=("sdpa",),
        backend="any",
        impl="kernels_core._portable._causal_mask:sdpa_is_causal",
        priority=0,
        supports=_TRAINABLE,
        dtypes=_ALL_FLOATS,
        description="under torch.compile, no dense causal mask where eager transformers passes none: SDPA's "
                    "is_causal kernels",
    ),
    KernelSpec(
        id="any.packed_attention.per_document",
        kind="packed_attention",
        variants=("causal", "sliding_window"),
        backend="any",
        impl="kernels_core._portable._packed_attention:packed_attention",
        priority=0,
        supports=Supports.BACKWARD,
        dtypes=_ALL_FLOATS,
        description="one causal SDPA call per document of a packed row (its is_causal kernels, no dense mask)",
    ),
    KernelSpec(
        id="any.packed_attention.flex",
        kind="packed_attention",
        variants=("masked",),
        backend="any",
        impl="kernels_core._portable._masked_attention:masked_attention",
        priority=0,
        supports=_TRAINABLE,
        dtypes=_ALL_FLOATS,
        description="under torch.compile, FlexAttention over the tiles the boolean mask shows (SDPA with the mask "
                    "where FlexAttention has no compiled kernel)",
    ),
    KernelSpec(
        id="any.sliding_window_attention.banded",
        kind="sliding_window_attention",
        variants=("sdpa",),
        backend="any",
        impl="kernels_core._portable._sliding_window:banded_sdpa",
        priority=0,
        supports=_TRAINABLE,
        dtypes=_ALL_FLOATS,
        description="SDPA one window of queries at a time over the keys the window reaches (about S x 2W scores "
                    "instead of S x S)",
    ),
    KernelSpec(
        # CPU only: on another backend it would take post-attention norms away from that backend's own RMSNorm
        # kernel (the portable add + norm is no faster anywhere); a vendor declares its own fused kind there.
        id="cpu.residual_rms_norm.recompute",
        kind="residual_rms_norm",
        variants=("standard", "offset"),
        backend="cpu",
        impl="kernels_core._portable._residual_rms_norm:residual_rms_norm",
        priority=0,
        supports=_TRAINABLE,
        dtypes=_ALL_FLOATS,
        description="residual add, then the portable RMSNorm (recomputed in backward); no fusion in pure PyTorch",
        native_when_compiled=_NATIVE_FOR_COMPILED_INFERENCE,
    ),
    KernelSpec(
        id="any.rms_norm.recompute",
        kind="rms_norm",
        variants=("standard", "offset"),
        backend="any",
        impl="kernels_core._portable._rms_norm:rms_norm",
        priority=0,
        supports=_TRAINABLE,
        dtypes=_ALL_FLOATS,
        description="torch rms_norm in the module's precision; recomputed in backward instead of saved",
        native_when_compiled=_NATIVE_FOR_COMPILED_INFERENCE,
    ),
    KernelSpec(
        id="any.silu_gated_mlp.recompute",
        kind="silu_gated_mlp",
        variants=("split", "fused"),
        backend="any",
        impl="kernels_core._portable._silu_mul:silu_mul",
        priority=0,
        supports=_TRAINABLE,
        dtypes=_ALL_FLOATS,
        description="silu(gate) * up saving gate and up only; silu recomputed in backward",
        native_when_compiled=_NATIVE_FOR_COMPILED_INFERENCE,
    ),
)
