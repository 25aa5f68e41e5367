"""A test plugin implementing every core layer kind with the reference math, counting calls per kernel.

Because each kernel is the reference math itself, a kernelized model must reproduce eager outputs and
gradients to rounding: any mismatch points at a matcher that accepted a module whose math differs, or an
adapter that calls the kernel wrongly.
"""

from __future__ import annotations

from collections import Counter

import torch
from kernels_core import KernelSpec
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import reference


CALLS: Counter[str] = Counter()
_ALL = Supports.BACKWARD | Supports.TORCH_COMPILE
_DTYPES = ("float16", "bfloat16", "float32")


def rms_norm(x, weight, *, eps, offset, casting):
    CALLS["rms_norm"] += 1
    return reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting)


def residual_rms_norm(x, residual, weight, *, eps, offset, casting):
    CALLS["residual_rms_norm"] += 1
    return reference.residual_rms_norm(x, residual, weight, eps=eps, offset=offset, casting=casting)


def layer_norm(x, weight, bias, *, eps):
    CALLS["layer_norm"] += 1
    return reference.layer_norm(x, weight, bias, eps=eps)


def silu_mul(gate, up):
    CALLS["silu_gated_mlp"] += 1
    return reference.gated_activation(gate, up, activation="silu")


def gelu_tanh_mul(gate, up):
    CALLS["gelu_gated_mlp"] += 1
    return reference.gated_activation(gate, up, activation="gelu_tanh")


def rotary(q, k, cos, sin, unsqueeze_dim=1):
    CALLS["rotary_embedding"] += 1
    return reference.rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def causal_lm_loss(hidden, weight, labels, *, bias, ignore_index, num_items_in_batch, softcap, logit_scale=None):
    CALLS["causal_lm_loss"] += 1
    return reference.causal_lm_loss(hidden, weight, labels, bias=bias, ignore_index=ignore_index,
                                    num_items_in_batch=num_items_in_batch, softcap=softcap, logit_scale=logit_scale)


def _experts(activation):
    def experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
        CALLS["moe_experts"] += 1
        return reference.moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                     activation=activation)
    return experts


experts_silu = _experts("silu")
experts_gelu_tanh = _experts("gelu_tanh")

_M = "reference_plugin"
SPECS = (
    KernelSpec(id="ref.rms_norm", kind="rms_norm", variants=("standard", "offset"), backend="any",
               impl=f"{_M}:rms_norm", priority=50, supports=_ALL, dtypes=_DTYPES),
    KernelSpec(id="ref.residual_rms_norm", kind="residual_rms_norm", variants=("standard", "offset"), backend="any",
               impl=f"{_M}:residual_rms_norm", priority=50, supports=_ALL, dtypes=_DTYPES),
    KernelSpec(id="ref.layer_norm", kind="layer_norm", variants=("bias", "no_bias"), backend="any",
               impl=f"{_M}:layer_norm", priority=50, supports=_ALL, dtypes=_DTYPES),
    KernelSpec(id="ref.silu_gated_mlp", kind="silu_gated_mlp", variants=("split", "fused"), backend="any",
               impl=f"{_M}:silu_mul", priority=50, supports=_ALL, dtypes=_DTYPES),
    KernelSpec(id="ref.gelu_gated_mlp", kind="gelu_gated_mlp", variants=("split", "fused"), backend="any",
               impl=f"{_M}:gelu_tanh_mul", priority=50, supports=_ALL, dtypes=_DTYPES),
    KernelSpec(id="ref.rotary", kind="rotary_embedding", variants=("full", "partial"), backend="any",
               impl=f"{_M}:rotary", priority=50, supports=_ALL, dtypes=_DTYPES),
    KernelSpec(id="ref.causal_lm_loss", kind="causal_lm_loss", variants=("standard", "softcap", "scaled"),
               backend="any", impl=f"{_M}:causal_lm_loss", priority=50, supports=_ALL, dtypes=_DTYPES),
    KernelSpec(id="ref.moe_experts_silu", kind="moe_experts", variants=("silu",), backend="any",
               impl=f"{_M}:experts_silu", priority=50, supports=_ALL, dtypes=_DTYPES),
    KernelSpec(id="ref.moe_experts_gelu", kind="moe_experts", variants=("gelu_tanh",), backend="any",
               impl=f"{_M}:experts_gelu_tanh", priority=50, supports=_ALL, dtypes=_DTYPES),
)


@hookimpl
def kernels_core_kernels():
    return SPECS


assert all(isinstance(s, KernelSpec) for s in SPECS) and torch is not None
