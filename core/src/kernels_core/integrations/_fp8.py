"""The ``fp8`` shorthand of the integrations: a request for the FP8 linear kernels of one torchao recipe.

``fp8="rowwise"`` (``KernelizeCallback``) or ``fp8: rowwise`` (LLaMA-Factory's ``kernel_config``) means

.. code-block:: toml

    [kinds.linear]
    prefer = { any = ["cuda.linear.float8_rowwise"] }

with every installed kernel of the ``linear`` kind named ``<backend>.linear.float8_<recipe>`` in the list. The key
``any`` makes it a request for every linear projection the kind takes, wherever it runs: on a device no listed
kernel serves (the CPU, a GPU older than Ada / Hopper, torchao missing, a mode without ``Mode.TORCH_COMPILE``)
kernelize raises instead of training in bf16 unannounced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._config import KernelsConfig
from .._errors import ConfigError
from .._hints import did_you_mean
from .._plugins._manager import KernelsPluginManager


__all__ = ["FP8_RECIPES", "apply_fp8", "check_fp8", "fp8_kernels", "fp8_request", "merge_fp8"]

FP8_RECIPES = ("rowwise", "tensorwise")
_KIND = "linear"


def check_fp8(value: object, where: str) -> str | None:
    """``value`` if it names a recipe (or is None), else raise ``ConfigError`` naming ``where``.

    Example:
        >>> check_fp8("rowwise", "fp8")
        'rowwise'
        >>> check_fp8("rowise", "fp8")
        Traceback (most recent call last):
        ...
        kernels_core.ConfigError: fp8: unknown FP8 recipe 'rowise' (did you mean 'rowwise'?); ...
    """
    if value is None or value in FP8_RECIPES:
        return value  # type: ignore[return-value]
    hint = did_you_mean(str(value), FP8_RECIPES) if isinstance(value, str) else ""
    raise ConfigError(f"{where}: unknown FP8 recipe {value!r}{hint}; allowed: {', '.join(FP8_RECIPES)} "
                      "(torchao's float8 recipes), or None for bf16")


def fp8_kernels(recipe: str, pm: KernelsPluginManager) -> tuple[str, ...]:
    """The installed ``linear`` kernels of ``recipe`` (``<backend>.linear.float8_<recipe>``); raises if none."""
    ids = tuple(p.spec.id for p in pm.kernels() if p.spec.kind == _KIND and p.spec.id.endswith(f".float8_{recipe}"))
    if not ids:
        raise ConfigError(f"fp8={recipe!r}: no installed plugin declares an FP8 linear kernel (*.linear.float8_"
                          f"{recipe}); kernels-cuda does: pip install 'kernels-cuda[fp8]'")
    return ids


def fp8_request(recipe: str, pm: KernelsPluginManager) -> dict[str, Any]:
    """The configuration mapping ``fp8=recipe`` stands for."""
    return {"kinds": {_KIND: {"prefer": {"any": list(fp8_kernels(recipe, pm))}}}}


def _conflict(prefer: Mapping[str, object], source: str) -> None:
    if any(prefer.values()):
        raise ConfigError(f"{source}: both the fp8 shorthand and [kinds.{_KIND}] prefer ({dict(prefer)}) choose the "
                          "linear kernels; give one of them")


def apply_fp8(config: KernelsConfig, recipe: str | None, pm: KernelsPluginManager, *, source: str) -> KernelsConfig:
    """``config`` with the request of ``recipe`` added (unchanged for None); raises if ``config`` already chooses
    the linear kernels itself."""
    if recipe is None:
        return config
    _conflict(config.kind(_KIND).prefer, source)
    linear = dataclasses.replace(config.kind(_KIND), prefer={"any": fp8_kernels(recipe, pm)})
    origins = {**config.origins, ("kinds", _KIND, "prefer"): source, ("kinds", _KIND, "prefer", "any"): source}
    return dataclasses.replace(config, kinds={**config.kinds, _KIND: linear}, origins=origins)


def merge_fp8(config: Mapping[str, Any], recipe: str | None, pm: KernelsPluginManager, *, source: str
              ) -> Mapping[str, Any]:
    """A configuration mapping with the request of ``recipe`` added (unchanged for None)."""
    if recipe is None:
        return config
    kinds = config.get("kinds", {})
    linear = kinds.get(_KIND, {}) if isinstance(kinds, Mapping) else {}
    prefer = linear.get("prefer", {}) if isinstance(linear, Mapping) else {}
    _conflict(prefer if isinstance(prefer, Mapping) else {}, source)
    request = fp8_request(recipe, pm)["kinds"][_KIND]
    return {**config, "kinds": {**kinds, _KIND: {**linear, **request}}}
