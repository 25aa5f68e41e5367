"""``kernelize`` and ``unkernelize``: load the configuration, plan every module, bind all or nothing, report."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any
from typing import TypeVar

import torch
from torch import nn

from ._binding import rebind
from ._binding import unbind_all
from ._config import KernelsConfig
from ._config import load_config
from ._forward import bindings
from ._plan import plan_kernels
from ._plugins._manager import KernelsPluginManager
from ._plugins._manager import get_plugin_manager
from ._report import KernelizeReport
from ._report import as_now
from ._types import Mode


__all__ = ["get_report", "kernelize", "unkernelize"]

logger = logging.getLogger("kernels_core")

ModelT = TypeVar("ModelT", bound=nn.Module)


def _resolve_mode(model: nn.Module, mode: Mode | None) -> Mode:
    if mode is None:
        return Mode.TRAINING if model.training else Mode.INFERENCE
    if not isinstance(mode, Mode):
        raise TypeError(f"mode must be a kernels_core.Mode (INFERENCE or TRAINING, optionally | TORCH_COMPILE), "
                        f"got {mode!r}")
    return mode.validate()


def kernelize(
    model: ModelT,
    *,
    mode: Mode | None = None,
    device: str | torch.device | None = None,
    config: dict[str, Any] | str | KernelsConfig | None = None,
    strict: bool = False,
    plugin_manager: KernelsPluginManager | None = None,
) -> ModelT:
    """Bind the best available kernel to every module whose math a kernel implements, per instance.

    Every module is classified and every choice made before anything changes; then all bindings are applied,
    or, if one fails, none. Kernelizing again re-resolves from scratch; :func:`unkernelize` restores every
    module exactly. The outcome is available from :func:`get_report`.

    Example:
        >>> import torch, kernels_core
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(8))
        >>> kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE) is model
        True

    Args:
        model: the model (any ``nn.Module``); modified in place and returned.
        mode: ``Mode.INFERENCE`` or ``Mode.TRAINING``, optionally ``| Mode.TORCH_COMPILE``; defaults to
            ``model.training``.
        device: resolve every module as if it ran on this device or backend (``"cuda:1"``, ``"npu"``,
            ``"rocm"``; a backend or device type means its first detected device); by default each module's own
            device decides, so ``device_map`` models get a choice per device. The report names the device as a
            tensor on it prints its device (``device="rocm"`` reports ``cuda:0``).
        config: a dict or TOML path, overriding the environment and file configuration.
        strict: raise if a matched module that could get a kernel on its backend got none. A module could get
            one when an installed kernel of its kind declares the module's backend (or ``"any"``) and
            configuration does not disable that kernel, its plugin or the kind; such a module left without a
            kernel (variant, mode, dtype, capability, architecture, a missing requirement or a load failure ruled
            every such kernel out) raises, and so does broken plugin code met on the way, even where another
            kernel took over: a matcher or adapter that raised, a kernel whose output on the matcher's probe did
            not have the module's shape, dtype or device. A kind with no kernel for the backend at all, a kind or
            kernel disabled by configuration, a declined module (its math differs), a module left alone because
            other code replaced its forward, and a module covered by an enclosing module's kernel are reported,
            never fatal. ``strict = true`` in the configuration means the same; ``[kinds.<name>] strict`` applies
            the rule to one kind (``false`` exempts it). Names in the configuration are not affected: those that
            match nothing installed warn either way (``core/docs/configuration.md``, "Strictness").
        plugin_manager: use this manager instead of the process-wide one (tests, embedding frameworks).

    Raises:
        KernelizeError: an explicit request (``device``, ``strict``, a configured preference) cannot be
            honoured, binding failed, or other code replaced an attribute an earlier kernelize bound (a wrapper
            re-kernelizing would drop); the model is unchanged.
        ConfigError: the configuration is malformed or names an option its kind does not declare. A layer kind,
            kernel, plugin or backend name that is not installed warns with :class:`~kernels_core.ConfigWarning`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"kernelize expects a torch.nn.Module, got {type(model).__name__}")
    resolved_mode = _resolve_mode(model, mode)
    settings = load_config(config)
    if strict:
        settings = dataclasses.replace(settings, strict=True)
    pm = plugin_manager or get_plugin_manager()
    plan = plan_kernels(model, pm, settings, resolved_mode, device)
    rebind(model, plan.report, None if plan.report.disabled else bindings(plan.forwards, pm.bind_hook_of))
    logger.info(plan.report.summary())
    return model


def unkernelize(model: ModelT) -> ModelT:
    """Undo every binding kernelize made on ``model`` and its sub-modules, restoring them exactly.

    ``model`` may be a wrapper holding the kernelized model as a sub-module (PEFT, DDP): the report of every module
    under it is dropped with the bindings.

    Raises :class:`KernelizeError`, changing nothing, if other code replaced an attribute kernelize bound since
    (accelerate's mixed-precision wrapper, an accelerate hook, TRL's fused LM head): restoring it would drop that
    code. The error names the module, the attribute and what replaced it.

    Example:
        >>> import torch, kernels_core
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(8))
        >>> model = kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE)
        >>> kernels_core.unkernelize(model) is model
        True
    """
    restored = unbind_all(model)
    logger.info("unkernelize: restored %d module(s)", restored)
    return model


def get_report(model: nn.Module) -> KernelizeReport | None:
    """The report of the last kernelize call on ``model``, true to the model as it is now; None if it was never
    kernelized or was restored.

    A kernel that no longer runs where kernelize bound it shows as not applied, its id in ``fell_back`` and the
    reason in ``reason``: the model was converted to a dtype the kernel does not declare (``model.double()``) or
    moved to another device type, or loaded where the kernel is not installed or cannot be built, so the module's
    own forward runs; or its binding was removed since. Modules covered by such a kernel run their own forward
    again and say so.

    Example:
        >>> import torch, kernels_core
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(8))
        >>> model = kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE)
        >>> kernels_core.get_report(model).mode
        'INFERENCE'
        >>> kernels_core.get_report(kernels_core.unkernelize(model)) is None
        True
    """
    return as_now(model)
