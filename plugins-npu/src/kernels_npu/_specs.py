"""What kernels-npu declares to kernels-core: its kernels and its ``attention`` layer kind, as plain data."""

from __future__ import annotations

import dataclasses

from kernels_core.plugin import KernelSpec
from kernels_core.plugin import LayerKind
from kernels_core.plugin import Supports

from ._detect import BACKEND
from ._detect import PRIORITY


__all__ = ["attention_kind", "kernel_specs"]

_P = "kernels_npu"
# Every operator used has a backward in torch_npu (npu_grouped_matmul through our autograd.Function), so every
# kernel is training-capable. None claims torch.compile: the operators' compile behaviour on Ascend
# (torchair / meta registrations) cannot be verified without the hardware, and npu_fusion_attention is
# documented as unsupported in graph mode.
_TRAINABLE = Supports.BACKWARD
_DTYPES = ("float16", "bfloat16", "float32")


def kernel_specs() -> tuple[KernelSpec, ...]:
    """The kernels this plugin offers, without importing torch_npu or any kernel module.

    Example:
        >>> sorted(spec.kind for spec in kernel_specs())
        ['attention', 'moe_experts', 'residual_rms_norm', 'rms_norm', 'rotary_embedding', 'silu_gated_mlp']
    """
    return (
        KernelSpec(
            id="npu.rms_norm.fused", kind="rms_norm", variants=("standard", "offset"), backend=BACKEND,
            impl=f"{_P}._rms_norm:rms_norm", priority=PRIORITY, supports=_TRAINABLE, dtypes=_DTYPES,
            description="torch_npu.npu_rms_norm (offset variant passes 1 + weight as gamma)",
        ),
        KernelSpec(
            id="npu.residual_rms_norm.rms_norm", kind="residual_rms_norm", variants=("standard", "offset"),
            backend=BACKEND, impl=f"{_P}._rms_norm:residual_rms_norm", priority=PRIORITY, supports=_TRAINABLE,
            dtypes=_DTYPES,
            description="the residual add in PyTorch, then torch_npu.npu_rms_norm (keeps the post-attention norm "
                        "on the operator)",
        ),
        KernelSpec(
            id="npu.silu_gated_mlp.swiglu", kind="silu_gated_mlp", variants=("split", "fused"), backend=BACKEND,
            impl=f"{_P}._swiglu:silu_mul", priority=PRIORITY, supports=_TRAINABLE, dtypes=_DTYPES,
            description="torch_npu.npu_swiglu on [gate, up] (no copy when they are halves of gate_up_proj)",
        ),
        KernelSpec(
            id="npu.rotary_embedding.rotary_mul", kind="rotary_embedding", variants=("full", "partial"),
            backend=BACKEND, impl=f"{_P}._rotary:apply_rotary", priority=PRIORITY, supports=_TRAINABLE,
            dtypes=_DTYPES,
            description="torch_npu.npu_rotary_mul in 'half' mode; partial rotary by slice and concat",
        ),
        KernelSpec(
            id="npu.attention.fusion", kind="attention", variants=("causal", "bidirectional"), backend=BACKEND,
            impl=f"{_P}._fusion_attention:fusion_attention", priority=PRIORITY, supports=_TRAINABLE,
            dtypes=_DTYPES,
            description="torch_npu.npu_fusion_attention (GQA, bottom-right causal sparse_mode 3, dropout)",
        ),
        KernelSpec(
            id="npu.moe_experts.grouped_matmul", kind="moe_experts", variants=("silu",), backend=BACKEND,
            impl=f"{_P}._moe:moe_experts", priority=PRIORITY, supports=_TRAINABLE, dtypes=_DTYPES,
            description="npu_moe_token_permute, npu_grouped_matmul, npu_swiglu, npu_moe_token_unpermute",
        ),
    )


def attention_kind() -> LayerKind:
    """The ``attention`` layer kind (see :mod:`kernels_npu._attention` for its calling convention)."""
    options: dict[str, object] = {}
    # The attention function is a global of the module's forward, rerouted per instance by the core.
    if any(f.name == "target" for f in dataclasses.fields(LayerKind)):
        options["target"] = "global"
    return LayerKind(
        name="attention",
        description="a transformers attention module's attention function (ALL_ATTENTION_FUNCTIONS), per instance",
        variants=("causal", "bidirectional"),
        matcher=f"{_P}._attention:match",
        adapter=f"{_P}._attention:adapt",
        **options,
    )
