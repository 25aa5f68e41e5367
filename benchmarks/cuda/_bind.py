"""Kernelize a model for the benchmarks: through ``kernels_core.kernelize`` when the core provides it, else a
benchmark-only stand-in that binds the same kernel functions to Qwen3-style modules per instance.

The stand-in exists only so that the CUDA kernels could be measured before the core's ``kernelize`` landed; its
choices mirror what kernels-cuda declares (tuned RMSNorm, Liger SiLU-mul / RoPE / fused linear cross-entropy in
eager; ATen math plus the fused-loss custom op under torch.compile).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def kernelize(model, *, training: bool, compile_mode: bool, stand_in: bool = False) -> str:
    if stand_in:
        _stand_in(model, compile_mode=compile_mode)
        return "benchmark stand-in"
    try:
        from kernels_core import Mode
        from kernels_core import kernelize as core_kernelize
    except ImportError:
        core_kernelize = None
    if core_kernelize is not None:
        mode = Mode.TRAINING if training else Mode.INFERENCE
        if compile_mode:
            mode = mode | Mode.TORCH_COMPILE
        core_kernelize(model, mode=mode)
        return "kernels_core.kernelize"
    _stand_in(model, compile_mode=compile_mode)
    return "benchmark stand-in (core kernelize not available)"


def _stand_in(model, *, compile_mode: bool) -> None:
    from kernels_cuda import _ops
    from kernels_triton import _gated
    from kernels_triton import _loss
    from kernels_triton import _native
    from kernels_triton import _rope
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.models.qwen3 import modeling_qwen3

    norm = _native.rms_norm if compile_mode else _ops.rms_norm
    act = _native.silu_mul if compile_mode else _gated.silu_mul
    rope = _native.rotary_embedding if compile_mode else _rope.rotary_embedding
    for module in model.modules():
        if isinstance(module, modeling_qwen3.Qwen3RMSNorm):
            module.forward = types.MethodType(
                lambda self, x: norm(x, self.weight, eps=self.variance_epsilon, offset=0.0, casting="llama"), module
            )
        elif isinstance(module, modeling_qwen3.Qwen3MLP):
            module.forward = types.MethodType(
                lambda self, x: self.down_proj(act(self.gate_proj(x), self.up_proj(x))), module
            )
    # RoPE is a free function in transformers: the stand-in can only reroute it module-wide.
    modeling_qwen3.apply_rotary_pos_emb = rope

    def forward(self, input_ids=None, labels=None, attention_mask=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        if labels is None:
            return CausalLMOutputWithPast(logits=self.lm_head(hidden))
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = _loss.fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            self.lm_head.weight,
            shifted.reshape(-1),
            bias=None,
            ignore_index=-100,
            num_items_in_batch=None,
            softcap=None,
        )
        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = types.MethodType(forward, model)
    torch.cuda.synchronize()
