"""What a kernel that reads a linear child's weight instead of calling it must feed itself, per wrapper.

The fused causal-LM loss computes ``lm_head(hidden)`` inside the kernel from a weight and a bias. That is only
right when the child's forward is ``F.linear(hidden, weight, bias)``. Training tools wrap the head: PEFT's LoRA
layer computes ``x W^T + b + sum_a s_a * (drop_a(x) A_a^T) B_a^T`` while exposing the frozen base ``W`` as
``.weight`` (reading it silently trains nothing), ``modules_to_save`` runs a trainable copy, and quantized linears
(bitsandbytes' ``Linear4bit``, whose ``.weight`` is packed 4-bit data) compute from something else entirely.

:func:`linear_operands` looks at the child as its forward would run *now* and returns a function giving
``(hidden', weight', bias')`` with ``F.linear(hidden', weight', bias') == child(hidden)``, or the reason no such
operands exist. LoRA is exact this way: ``[x, s * A drop(x)] @ [W, B]^T = x W^T + s * (drop(x) A^T) B^T``, so the
kernel trains ``B`` through the concatenated weight's gradient and ``A`` through the extra hidden columns, with the
dropout masks drawn in the same order as PEFT's forward. The check is cheap (type and dict lookups) and runs at
every fused call, so a wrapper applied after kernelize is seen (hooks are judged at kernelize time only).

Example:
    >>> import torch
    >>> head = torch.nn.Linear(4, 3)
    >>> operands = linear_operands(head)
    >>> hidden, weight, bias = operands(torch.randn(2, 4))
    >>> weight is head.weight, bias is head.bias
    (True, True)
    >>> linear_operands(torch.nn.Sequential(head))
    'lm_head is Sequential, not a linear layer the fused loss can read'
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from ._context import dtensor_placements
from ._zero3 import hooks_problem


__all__ = ["Operands", "linear_operands", "plain_weight_problem", "wrapped_module"]

Operands = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def plain_weight_problem(tensor: object, what: str) -> str | None:
    """Why ``tensor`` is not a floating-point weight a kernel can take as it is (a quantized tensor subclass?)."""
    if not isinstance(tensor, torch.Tensor):
        return f"{what} is {type(tensor).__name__}, not a tensor"
    if type(tensor) not in (nn.Parameter, torch.Tensor) and dtensor_placements(tensor) is None:
        # bitsandbytes' Params4bit / Int8Params, torchao's quantized tensors: F.linear dispatches them to their own
        # matmul, a kernel would read the packed storage.
        return f"{what} is a {type(tensor).__name__} (quantized?), not a plain floating-point tensor"
    if not tensor.is_floating_point():
        return f"{what} has dtype {tensor.dtype}, not a floating-point dtype"
    return None


def _hooked(module: nn.Module, hooks: bool) -> bool:
    # DeepSpeed ZeRO-3's own parameter hooks are not bypassed: the fused loss runs them around the kernel.
    return hooks and bool(module._forward_hooks or module._forward_pre_hooks) and hooks_problem(module) is not None


def _peft_class(module_name: str, class_name: str) -> type | None:
    """A PEFT class if PEFT is imported already (a module cannot be PEFT's otherwise); never imports PEFT."""
    module = sys.modules.get(module_name)
    value = getattr(module, class_name, None) if module is not None else None
    return value if isinstance(value, type) else None


def linear_operands(module: nn.Module, name: str = "lm_head", *, hooks: bool = True) -> Operands | str:
    """``hidden -> (hidden', weight', bias')`` reproducing ``module(hidden)`` as one ``F.linear``, or why not.

    ``hooks=False`` leaves forward hooks out of the question: at call time they are left to whoever added them
    after kernelize (DeepSpeed ZeRO-3 hooks every module to gather its parameters; tests count calls with hooks).
    """
    if _hooked(module, hooks):
        return (f"{name} has forward hooks (tensor parallel, adapters, quantizers?); the fused loss reads its weight "
                "without calling it and would bypass them")
    if type(module) is nn.Linear or (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward):
        # From the dict, not the attribute: under DeepSpeed ZeRO-3 reading a partitioned parameter through the module
        # gathers it and registers it on the running module as an external parameter (kept gathered all step).
        weight = module._parameters.get("weight")
        problem = plain_weight_problem(module.weight if weight is None else weight, f"{name}'s weight")
        if problem:
            return problem
        # Read when the kernel runs, not now: FSDP2 swaps the sharded parameters for the gathered ones in between.
        return lambda hidden: (hidden, module.weight, module.bias)
    lora = _peft_class("peft.tuners.lora.layer", "Linear")
    if lora is not None and type(module) is lora:
        return _lora_operands(module, name, hooks)
    saved = _peft_class("peft.utils.other", "ModulesToSaveWrapper")
    if saved is not None and type(module) is saved:
        return _modules_to_save_operands(module, name, hooks)
    if isinstance(module, nn.Linear):
        return (f"{name} is {type(module).__name__}, a linear layer with its own forward (quantized?); the fused "
                "loss cannot reproduce it from a weight")
    return f"{name} is {type(module).__name__}, not a linear layer the fused loss can read"


def _saved_target(wrapper: nn.Module) -> nn.Module | str:
    """The module a PEFT ``ModulesToSaveWrapper``'s forward runs now: the active adapter's trainable copy, or the
    original where it passes through (adapters disabled, or an active adapter that does not train this module)."""
    try:
        active = list(wrapper.active_adapters)
        adapters = wrapper._adapters
        passthrough = wrapper.disable_adapters or not active or any(a not in adapters for a in active)
        return wrapper.original_module if passthrough else wrapper.modules_to_save[active[0]]
    except (AttributeError, KeyError, TypeError) as exc:
        return f"a PEFT ModulesToSaveWrapper of an unknown layout ({type(exc).__name__}: {exc})"


def wrapped_module(module: nn.Module) -> nn.Module | None:
    """The module whose forward ``module``'s forward runs as it is, for a pass-through wrapper kernels-core knows
    (PEFT ``modules_to_save``), ``module`` itself otherwise; None for a wrapper of an unknown layout."""
    saved = _peft_class("peft.utils.other", "ModulesToSaveWrapper")
    if saved is None or type(module) is not saved:
        return module
    target = _saved_target(module)
    return None if isinstance(target, str) else target


def _modules_to_save_operands(wrapper: nn.Module, name: str, hooks: bool) -> Operands | str:
    """PEFT ``modules_to_save``: the operands of the copy its forward runs."""
    target = _saved_target(wrapper)
    if isinstance(target, str):
        return f"{name} is {target}"
    return linear_operands(target, f"{name} (modules_to_save)", hooks=hooks)


def _lora_operands(layer: nn.Module, name: str, hooks: bool) -> Operands | str:
    """PEFT's ``lora.Linear``: base operands, plus per active adapter ``s * A drop(x)`` columns and ``B`` rows."""
    try:
        disabled, merged = layer.disable_adapters, layer.merged
        variants = layer.lora_variant
        adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    except AttributeError as exc:
        return f"{name} is a PEFT LoRA layer of an unknown layout ({exc})"
    if disabled and merged:
        return f"{name} is a PEFT LoRA layer with adapters disabled but merged (its forward unmerges them first)"
    base = linear_operands(layer.base_layer, f"{name}'s base layer", hooks=hooks)
    if isinstance(base, str) or disabled or merged or not adapters:
        # Disabled, or merged into the base weight: the forward is the base layer's.
        return base
    for adapter in adapters:
        if adapter in variants:
            return (f"{name} is a PEFT LoRA layer whose adapter {adapter!r} is a {type(variants[adapter]).__name__} "
                    "(DoRA or another variant), not x W^T + s (x A^T) B^T; the fused loss cannot fold it")
        lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
        if type(lora_b) is not nn.Linear or lora_b.bias is not None or _hooked(lora_b, hooks):
            return (f"{name} is a PEFT LoRA layer whose lora_B of adapter {adapter!r} is not a plain bias-free linear "
                    "(lora_bias?); the fused loss cannot fold it")
        problem = plain_weight_problem(lora_b.weight, f"{name}'s lora_B of adapter {adapter!r}")
        if problem:
            return problem
        if not (isinstance(lora_a, nn.Module) and isinstance(getattr(lora_a, "weight", None), torch.Tensor)
                and isinstance(layer.scaling.get(adapter), (int, float))):
            return f"{name} is a PEFT LoRA layer of an unknown layout (adapter {adapter!r})"

    def operands(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x, weight, bias = base(hidden)
        columns, rows = [x], [weight]
        # PEFT's forward, adapter by adapter: cast (cumulatively) to lora_A's dtype, dropout, A, scale; the dropout
        # masks come from the generator in the same order. B joins the weight; its part of the weight's gradient
        # is B's gradient, the extra columns' gradient flows back through A.
        lora_input = hidden
        for adapter in adapters:
            lora_a = layer.lora_A[adapter]
            lora_input = layer._cast_input_dtype(lora_input, lora_a.weight.dtype)
            low_rank = lora_a(layer.lora_dropout[adapter](lora_input)) * layer.scaling[adapter]
            columns.append(low_rank.to(x.dtype))
            rows.append(layer.lora_B[adapter].weight.to(weight.dtype))
        return torch.cat(columns, dim=-1), torch.cat(rows, dim=-1), bias

    return operands
