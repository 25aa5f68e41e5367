"""FP8 linear layers on torchao's float8 training: the ``linear`` kind's kernels (``_float8_specs``).

Each call runs torchao's float8 matmul autograd function on the module's own weight: the input and the weight are
cast to FP8 with dynamic scales (one per tensor, or one per row), multiplied on FP8 tensor cores with the result in
the input's dtype, and the backward does the same for both gradient products. Nothing is stored on the module: the
weight stays the module's ``nn.Parameter`` in bf16 (the optimizer and FSDP2 see nothing new; FSDP2 gathers it in
bf16, torchao's float8 all-gather is not used), and ``unkernelize`` gives the module its plain forward back.

Rows (batch x sequence) that are not a multiple of 16 are allowed: the weight gradient's product, whose inner
dimension they are, then pads it with zeros (torchao's ``pad_inner_dim``), for those calls only.

Importing this module imports torchao; the kernels' declared requirement keeps kernelize from loading it where
torchao is missing.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import LinearMMConfig
from torchao.float8.float8_training_tensor import ScaledMMConfig

from ._float8_specs import RECIPES


__all__ = ["float8_linear", "float8_rowwise_linear", "float8_tensorwise_linear"]

ALIGNMENT = 16


class _Recipe(NamedTuple):
    config: Float8LinearConfig
    aligned: LinearMMConfig  # rows a multiple of 16
    padded: LinearMMConfig  # other row counts: the weight gradient's product pads its inner dimension


def _gemm_configs(config: Float8LinearConfig, *, pad: bool) -> LinearMMConfig:
    # As torchao's Float8Linear builds them: output, grad_input, grad_weight.
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    return LinearMMConfig(*(ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, pad) for gemm in gemms))


def _recipe(name: str, *, emulate: bool) -> _Recipe:
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=emulate)
    return _Recipe(config, _gemm_configs(config, pad=False), _gemm_configs(config, pad=True))


# Built once at import: immutable, so torch.compile treats them as constants.
_RECIPES = {(name, emulate): _recipe(name, emulate=emulate) for name in RECIPES for emulate in (False, True)}


def float8_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, recipe: str,
                  emulate: bool = False) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` with FP8 matrix products in the forward and the backward.

    ``emulate=True`` computes the same FP8 roundings with float32 products (torchao's emulation), on any device:
    for checking the numbers where no FP8 tensor cores are.

    Example:
        >>> import torch
        >>> x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
        >>> w = torch.randn(48, 32, dtype=torch.bfloat16)
        >>> y = float8_linear(x, w, recipe="rowwise", emulate=True)
        >>> y.shape, y.dtype
        (torch.Size([2, 16, 48]), torch.bfloat16)
        >>> bool((y - x @ w.t()).abs().max() <= 0.125 * (x @ w.t()).abs().max())
        True
    """
    chosen = _RECIPES[(recipe, emulate)]
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):
        # What F.linear does under autocast: both operands (and the bias) in the autocast dtype.
        dtype = torch.get_autocast_dtype(device_type)
        input, weight = input.to(dtype), weight.to(dtype)
    rows = input.numel() // input.shape[-1] if input.shape[-1] else 0
    gemms = chosen.aligned if rows % ALIGNMENT == 0 else chosen.padded
    output = matmul_with_hp_or_float8_args.apply(input, weight.t(), gemms, chosen.config)
    if bias is not None:
        output = output + bias.to(output.dtype)
    return output


def float8_tensorwise_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """:func:`float8_linear` with one scale per tensor (e4m3 operands, e5m2 output gradients; cuBLAS' FP8 GEMM)."""
    return float8_linear(input, weight, bias, recipe="tensorwise")


def float8_rowwise_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """:func:`float8_linear` with one power-of-two scale per row (e4m3 throughout; CUTLASS' rowwise FP8 GEMM)."""
    return float8_linear(input, weight, bias, recipe="rowwise")
