"""The LLaMA-Factory v1 kernel plugin: options, the registered callable and the command-line runner."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from .._hints import did_you_mean
from .._types import Mode
from ._fp8 import check_fp8
from ._fp8 import merge_fp8


__all__ = ["OPTIONS", "PLUGIN_NAME", "kernelize_for_llamafactory", "register", "run_cli"]

logger = logging.getLogger("kernels_core.integrations.llamafactory")

PLUGIN_NAME = "kernels_core"
# Keys a ``kernel_config`` naming this plugin may hold. ``name`` and ``include_kernels`` are LLaMA-Factory's own.
OPTIONS = ("name", "include_kernels", "mode", "strict", "device", "config", "fp8")
_MODE_WORDS = {"inference": Mode.INFERENCE, "training": Mode.TRAINING, "torch_compile": Mode.TORCH_COMPILE,
               "compile": Mode.TORCH_COMPILE}
# LLaMA-Factory v1's trainers (SFT, DPO, reward) compute their losses from ``outputs.logits``, so the causal-LM
# loss keeps its logits unless the configuration says otherwise.
_LOSS_KEEPS_LOGITS = {"kinds": {"causal_lm_loss": {"options": {"materialize_logits": True}}}}
_ENGINE_MODULE = "llamafactory.v1.core.model_engine"
_TRAIN_COMMANDS = ("train", "sft", "dpo", "rm")


def _parse_mode(value: object) -> Mode | None:
    if value is None or isinstance(value, Mode):
        return value.validate() if isinstance(value, Mode) else None
    if not isinstance(value, str):
        raise ConfigError(f"kernel_config.mode: expected a string such as 'training' or 'inference+torch_compile', "
                          f"got {value!r}")
    mode = Mode(0)
    words = [w.strip().lower() for w in value.replace("|", "+").replace(",", "+").split("+") if w.strip()]
    for word in words:
        if word not in _MODE_WORDS:
            raise ConfigError(f"kernel_config.mode: unknown mode {word!r}{did_you_mean(word, list(_MODE_WORDS))}; "
                              f"allowed: {sorted(_MODE_WORDS)}, joined with '+'")
        mode |= _MODE_WORDS[word]
    try:
        return mode.validate()
    except ValueError as exc:
        raise ConfigError(f"kernel_config.mode {value!r}: {exc}") from None


def _parse_kinds(value: object, known: list[str]) -> tuple[str, ...] | None:
    """``include_kernels``: None, True or 'auto' mean every layer kind; otherwise the kinds to use."""
    if value is None or value is True or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if value is False:
        return ()
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"kernel_config.include_kernels: expected 'auto', true/false or layer kinds separated by "
                          f"commas, got {value!r}; layer kinds: {known}")
    for kind in value:
        if kind not in known:
            hint = did_you_mean(kind, known)
            raise ConfigError(f"kernel_config.include_kernels: unknown layer kind {kind!r}{hint}; "
                              f"layer kinds: {known}")
    return tuple(value)


def _merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(low)
    for key, value in high.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _config_mapping(value: object) -> Mapping[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return value
    if isinstance(value, (str, Path)):
        import tomllib

        path = Path(value)
        try:
            with path.open("rb") as handle:
                return tomllib.load(handle)
        except OSError as exc:
            raise ConfigError(f"kernel_config.config: cannot read {str(path)!r}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"kernel_config.config: {path}: invalid TOML: {exc}") from None
    raise ConfigError(f"kernel_config.config: expected a mapping (kernels-core configuration) or a TOML path, "
                      f"got {type(value).__name__}")


def _loading_engine() -> Any | None:
    """The LLaMA-Factory ``ModelEngine`` whose ``_init_model`` is calling this plugin, if any.

    LLaMA-Factory 0.9.5's ModelEngine hands a kernel plugin only ``model`` and ``include_kernels``; the rest of
    ``kernel_config`` (and whether it loads for training) is on the engine itself, two frames up.
    """
    engine_module = sys.modules.get(_ENGINE_MODULE)
    engine_type = getattr(engine_module, "ModelEngine", None)
    if engine_type is None:
        return None
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, engine_type):
            return candidate
        frame = frame.f_back
    return None


def kernelize_for_llamafactory(model: Any, *, include_kernels: object = None, **options: Any) -> Any:
    """Kernelize ``model`` as a LLaMA-Factory v1 kernel plugin; returns the same model.

    Called by LLaMA-Factory as ``KernelPlugin("kernels_core")(model=..., include_kernels=...)``. When a
    ``ModelEngine`` is loading the model, the other keys of its ``kernel_config`` are read from it: ``mode``
    (``training``, ``inference``, optionally ``+torch_compile``; default: training when the engine loads for
    training, else inference), ``strict``, ``device``, ``config`` (a kernels-core configuration mapping or
    TOML path) and ``fp8`` (``rowwise`` or ``tensorwise``: the decoder layers' linear projections as FP8 matrix
    products, with ``mode: training+torch_compile``; see ``KernelizeCallback``'s ``fp8``). ``include_kernels`` is
    ``auto`` (default), ``false``, or the layer kinds to use, separated by commas. Keyword ``options`` given here
    override those keys.

    Example:
        >>> import torch
        >>> from kernels_core.integrations.llamafactory import kernelize_for_llamafactory
        >>> model = torch.nn.Sequential(torch.nn.LayerNorm(8))
        >>> kernelize_for_llamafactory(model, mode="inference") is model
        True
        >>> kernelize_for_llamafactory(model, mdoe="inference")
        Traceback (most recent call last):
        ...
        kernels_core.ConfigError: kernel_config: unknown option 'mdoe' (did you mean 'mode'?); allowed: ...

    Raises:
        ConfigError: an unknown option or a malformed value; nothing was changed.
        KernelizeError: kernelize could not honour an explicit request; the model is exactly as it was.
    """
    from .. import _kernelize
    from .._plugins._manager import get_plugin_manager

    engine = _loading_engine()
    settings: dict[str, Any] = {}
    if engine is not None and getattr(engine.args, "kernel_config", None) is not None:
        settings.update(engine.args.kernel_config)
    if include_kernels is not None:
        settings["include_kernels"] = include_kernels
    settings.update(options)
    unknown = sorted(set(settings) - set(OPTIONS))
    if unknown:
        hint = did_you_mean(unknown[0], OPTIONS)
        raise ConfigError(f"kernel_config: unknown option {unknown[0]!r}{hint}; allowed: {', '.join(OPTIONS)}"
                          + (f" (also unknown: {unknown[1:]})" if unknown[1:] else ""))
    if settings.get("name", PLUGIN_NAME) != PLUGIN_NAME:
        raise ConfigError(f"kernel_config.name is {settings['name']!r}, but this is the {PLUGIN_NAME!r} plugin")
    mode = _parse_mode(settings.get("mode"))
    if mode is None and engine is not None:
        mode = Mode.TRAINING if getattr(engine, "is_train", False) else Mode.INFERENCE
    strict = settings.get("strict", False)
    if not isinstance(strict, bool):
        raise ConfigError(f"kernel_config.strict: expected true or false, got {strict!r}")
    device = settings.get("device")
    if device is not None and not isinstance(device, str):
        raise ConfigError(f"kernel_config.device: expected a device or backend name such as 'cuda:0', got {device!r}")
    fp8 = check_fp8(settings.get("fp8"), "kernel_config.fp8")
    config = _merge(_LOSS_KEEPS_LOGITS, _config_mapping(settings.get("config")))
    config = dict(merge_fp8(config, fp8, get_plugin_manager(), source=f"kernel_config.fp8={fp8!r}"))
    kinds = _parse_kinds(settings.get("include_kernels"), sorted(get_plugin_manager().layer_kinds()))
    if kinds == ():
        logger.info("kernel_config.include_kernels is false: %s left as it is", type(model).__name__)
        return model
    if kinds is not None:
        others = set(get_plugin_manager().layer_kinds()) - set(kinds)
        config = _merge(config, {"kinds": {kind: {"enabled": False} for kind in others}})
    try:
        _kernelize.kernelize(model, mode=mode, device=device, config=config, strict=strict)
    except Exception as exc:
        exc.add_note(f"raised by the LLaMA-Factory kernel plugin {PLUGIN_NAME!r}; the model was not changed")
        raise
    return model


def register() -> None:
    """Register ``KernelPlugin("kernels_core")`` with LLaMA-Factory v1 (idempotent)."""
    try:
        from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "llamafactory":
            raise ModuleNotFoundError(
                "kernels_core.integrations.llamafactory needs LLaMA-Factory 0.9.5 (the 'llamafactory' package) "
                "with its v1 kernel plugins, which is not installed: pip install 'kernels-core[llamafactory]'",
                name="llamafactory",
            ) from exc
        raise
    plugin = KernelPlugin(PLUGIN_NAME)
    if plugin._registry.get(PLUGIN_NAME, {}).get("__call__") is not kernelize_for_llamafactory:
        plugin.register()(kernelize_for_llamafactory)


def run_cli(argv: list[str] | None = None) -> None:
    """``python -m kernels_core.integrations.llamafactory sft config.yaml``: LLaMA-Factory v1 with the plugin.

    Training commands run in this process (under ``torchrun -m kernels_core.integrations.llamafactory ...``
    in each rank); LLaMA-Factory's own launcher would start ``torchrun`` on its own script, whose processes
    never import this plugin. Other commands go to LLaMA-Factory v1's launcher.
    """
    register()
    from llamafactory.v1 import launcher

    if argv is not None:
        sys.argv[1:] = argv
    if len(sys.argv) > 1 and sys.argv[1] in _TRAIN_COMMANDS:
        launcher.main()
    else:
        launcher.launch()
