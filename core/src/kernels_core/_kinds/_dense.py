"""The ``linear`` kind: ``nn.Linear`` projections inside decoder layers, for kernels that change their precision.

The kind exists for FP8 matrix products (kernels-cuda's ``cuda.linear.float8_rowwise`` / ``float8_tensorwise``),
which round every operand to 8 bits: results differ from the bf16 layer by design, so the kind is opt-in
(``LayerKind.opt_in``): kernelize visits it only where ``[kinds.linear] prefer`` names kernels, and never chooses
one on its own.

Which modules it takes:

- ``nn.Linear`` (or a subclass keeping ``nn.Linear.forward``) inside a decoder layer, i.e. below an element of an
  ``nn.ModuleList`` (``model.layers.3.self_attn.q_proj``, ``model.layers.3.mlp.down_proj``): variant
  ``projection``. Linears elsewhere (multimodal projectors, ...) are not the kind's.
- the ``lm_head`` only when ``[kinds.linear] options = { lm_head = true }`` asks for it (variant ``head``);
  otherwise it is reported as declined, with that how-to. Embeddings are lookups, not linears. The fused
  causal-LM loss reads ``lm_head``'s weight itself (in bf16) and would bypass the kernel, so with this option
  the ``causal_lm_loss`` kind declines, saying why: the loss runs unfused (``lm_head``, then transformers'
  cross-entropy on the whole logits) and the FP8 ``lm_head`` runs in training too.

Declined, with the reason in the report: in or out features not a multiple of 16 (``torch._scaled_mm`` needs
both), a layer wrapped by PEFT (LoRA's base layer, its adapter matrices, ``modules_to_save`` copies: FP8 training
of adapters is not verified), a MoE router (its logits choose the experts), a linear with its own forward
(bitsandbytes, other quantized layers) or a quantized / tensor-parallel weight. What the kernels need of the
device, dtype and mode (Hopper's FP8 tensor cores, bfloat16 weights, torchao, ``Mode.TORCH_COMPILE``) is declared
on the kernels: the explicit request then raises ``KernelizeError`` naming the reason, rather than being
quietly reported.

Calling convention: ``impl(input, weight, bias) -> output``, as ``torch.nn.functional.linear``; the adapter
reads the module's own ``weight`` and ``bias`` at each call (FSDP2 swaps in the gathered ones), so the module
keeps its parameters and an optimizer or FSDP2 sees nothing new.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._types import Decline
from .._types import Match
from ._context import MatchContext
from ._context import close
from ._context import dtensor_placements
from ._context import rel_error
from ._linear import plain_weight_problem


__all__ = ["FP8_BOUND", "FP8_BOUND_E5M2", "adapt_linear", "conformance_cases", "match_linear"]

KIND = "linear"
# torch._scaled_mm multiplies [M, K] by [K, N] with K and N multiples of 16.
ALIGNMENT = 16

# Bounds of an FP8 product against the bf16 one, as max|a - b| / max|b| (the measure of ``kernels-core check``).
# Rounding a value to FP8 with a per-tensor or per-row scale keeps it within half an ulp: a relative error of at
# most 2^-4 for e4m3 (3 mantissa bits) and 2^-3 for e5m2 (2 mantissa bits), subnormals aside (which lie 2^-14 and
# more below the scaled maximum and add at most that much absolute error). One term x_k * w_k of a product of two
# rounded operands is then off by at most u_x + u_w + u_x * u_w of itself; the bound is u_x + u_w, the first-order
# worst case of one term. A sum of many independently rounded terms lands well inside it (the errors partly
# cancel), and so does the output's own bf16 rounding (2^-9). With torchao 0.17, emulated on a CPU in float32 (the
# same casts as Hopper's FP8 GEMMs, accumulated in float32 too), the worst of 40 seeds over shapes [14..256] x
# [48..1024] x [80..336] was 0.054 for e4m3 x e4m3 products (every output, and every gradient of the rowwise
# recipe) and 0.101 for the tensorwise recipe's gradients, which round the output gradient to e5m2.
FP8_BOUND = 2.0**-4 + 2.0**-4  # e4m3 x e4m3: 0.125
FP8_BOUND_E5M2 = 2.0**-3 + 2.0**-4  # e5m2 x e4m3 (tensorwise gradients): 0.1875


def _decoder_layer(name: str, root: nn.Module) -> str | None:
    """The qualified name of the decoder layer (an element of an ``nn.ModuleList``) holding module ``name``."""
    parts = name.split(".")
    for index in range(1, len(parts) - 1):
        if not parts[index].isdigit():
            continue
        try:
            container = root.get_submodule(".".join(parts[:index]))
        except AttributeError:
            return None
        if isinstance(container, nn.ModuleList):
            return ".".join(parts[: index + 1])
    return None


def _peft_ancestor(name: str, layer: str, root: nn.Module) -> nn.Module | None:
    """A PEFT wrapper between the decoder layer and the module (LoRA layer, modules_to_save), if any."""
    parts = name.split(".")
    for end in range(len(layer.split(".")) + 1, len(parts)):
        ancestor = root.get_submodule(".".join(parts[:end]))
        if type(ancestor).__module__.split(".")[0] == "peft":
            return ancestor
    return None


def _features(module: nn.Linear) -> tuple[int, int]:
    return int(module.in_features), int(module.out_features)


def match_linear(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """Linear projections of decoder layers (and ``lm_head`` when asked), with the reason for those declined."""
    if not isinstance(module, nn.Linear):
        return None
    layer = _decoder_layer(name, ctx.root)
    if layer is None:
        if name.split(".")[-1] != "lm_head":
            return None
        if not ctx.options.get(KIND, {}).get("lm_head", False):
            return Decline(KIND, "lm_head stays in its own precision (it is not a decoder-layer projection); "
                                 "[kinds.linear] options = { lm_head = true } asks for it too")
        return _classify(module, ctx, "head", "the lm_head, asked for by [kinds.linear] options.lm_head")
    wrapper = _peft_ancestor(name, layer, ctx.root)
    if wrapper is not None:
        return Decline(KIND, f"wrapped by PEFT's {type(wrapper).__name__} (a LoRA base layer or adapter matrix, or "
                             "a modules_to_save copy): FP8 training of adapted layers is not verified")
    parent = ctx.root.get_submodule(name.rpartition(".")[0])
    if isinstance(parent._modules.get("experts"), nn.Module):
        return Decline(KIND, f"MoE router ({type(parent).__name__} holds the experts): its logits choose the "
                             "experts, so it keeps its own precision")
    return _classify(module, ctx, "projection", "a decoder-layer projection")


def _structure_problem(module: nn.Linear, ctx: MatchContext) -> str | None:
    if type(module) is not nn.Linear and type(module).forward is not nn.Linear.forward:
        return (f"{type(module).__name__} is a linear layer with its own forward (quantized?); an FP8 kernel "
                "replaces F.linear only")
    in_features, out_features = _features(module)
    if in_features % ALIGNMENT or out_features % ALIGNMENT:
        return (f"in_features {in_features} and out_features {out_features} must both be multiples of "
                f"{ALIGNMENT} (FP8 matrix products need it)")
    weight = module._parameters.get("weight")
    problem = plain_weight_problem(module.weight if weight is None else weight, "the weight")
    if problem:
        return problem
    if module.weight.device.type == "meta":
        return "parameters are on the meta device; the math cannot be verified"
    placements = dtensor_placements(module.weight)
    if placements is not None and not ctx.fsdp_managed(module):
        return f"weight is a DTensor {placements} (tensor parallel); the kernels take plain tensors"
    return None


def _classify(module: nn.Linear, ctx: MatchContext, variant: str, where: str) -> Match | Decline:
    problem = _structure_problem(module, ctx)
    if problem:
        return Decline(KIND, problem)
    # Probed once per variant and distinct shape, dtype and device (MatchContext.verdict), so that kernelize can run
    # the chosen kernel on the same rows and check what it returns.
    return ctx.verdict(f"{KIND}.{variant}", module, lambda: _probe(module, ctx, variant, where))


def _probe(module: nn.Linear, ctx: MatchContext, variant: str, where: str) -> Match | Decline:
    weight, bias = module.weight, module.bias
    gen = ctx.generator(weight.device)
    # 16 rows: a whole tile of the FP8 products' row dimension.
    x = ctx.randn(2, 8, module.in_features, device=weight.device, dtype=weight.dtype, gen=gen)
    try:
        outputs = ctx.run_probe(module, ctx.original_forward(module), x)
    except Exception as exc:  # noqa: BLE001 - a module we cannot probe is left alone
        return Decline(KIND, f"probe forward raised {type(exc).__name__}: {exc}")
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, weight, bias)
    if not all(close(actual, expected, weight.dtype) for actual in outputs):
        errors = [rel_error(a, expected) if isinstance(a, torch.Tensor) and a.shape == expected.shape
                  else float("inf") for a in outputs]
        return Decline(KIND, f"probe output differs from F.linear(x, weight, bias) (rel. error {max(errors):.1e}); "
                             "math differs")
    ctx.note_probe(module, KIND, (x,), {}, outputs[0])
    in_features, out_features = _features(module)
    return Match(KIND, variant, {}, evidence=f"Linear({in_features} -> {out_features}), {where}; probe matches "
                                             "F.linear")


def adapt_linear(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    """The module's forward through ``impl(input, weight, bias)``, reading its parameters at every call."""
    parameters = module._parameters

    def forward(input: torch.Tensor) -> torch.Tensor:
        # From the dict, as FSDP2 leaves the gathered parameters there; a weight replaced by a plain tensor (no
        # longer a parameter) is found through the attribute.
        weight = parameters.get("weight")
        return impl(input, module.weight if weight is None else weight, parameters.get("bias"))

    return forward


def conformance_cases() -> tuple[Any, ...]:
    """Two projections of a tiny Llama (48 -> 80 and 80 -> 48: multiples of 16, not powers of two), on 2 x 7 rows
    (not a multiple of 16: the weight gradient's product pads its inner dimension) and 2 x 8 rows.

    The bound is :data:`FP8_BOUND_E5M2` (0.1875) for outputs and gradients alike, as ``factor`` times the bfloat16
    tolerance: the loosest of the products a kernel of this kind computes (the tensorwise recipe's gradients round
    the output gradient to e5m2); see the comment above the bounds for the derivation and the measured errors.
    """
    from .._check import ConformanceCase
    from ..testing import tiny_causal_lm
    from ..testing import tolerance

    factor = FP8_BOUND_E5M2 / tolerance(torch.bfloat16)

    def build(target: str) -> Callable[[torch.device, torch.dtype], tuple[nn.Module, str]]:
        def located(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, str]:
            model = tiny_causal_lm("llama", dtype=dtype, hidden_size=48, intermediate_size=80, head_dim=12)
            return model.to(device), target

        return located

    def rows(tokens: int) -> Callable[[nn.Module, torch.Generator], tuple[tuple[Any, ...], dict[str, Any]]]:
        def inputs(target: nn.Module, generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
            x = torch.randn(2, tokens, target.in_features, generator=generator) * 2 + 0.3
            return (x.to(device=target.weight.device, dtype=target.weight.dtype),), {}

        return inputs

    return (
        ConformanceCase("projection", "LlamaMLP.gate_proj (48 -> 80), 2 x 7 rows",
                        build("model.layers.0.mlp.gate_proj"), rows(7), factor=factor),
        ConformanceCase("projection", "LlamaMLP.down_proj (80 -> 48), 2 x 8 rows",
                        build("model.layers.1.mlp.down_proj"), rows(8), factor=factor),
    )
