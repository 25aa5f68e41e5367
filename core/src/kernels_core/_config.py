"""Declarative configuration: which kernels to prefer, which to disable, and how strict to be.

Sources, highest precedence first: the ``config=`` argument of kernelize (a dict or a TOML path), the file named
by ``KERNELS_CORE_CONFIG`` (plus the ``KERNELS_CORE_DISABLE`` switch), then ``kernels.toml`` or
``[tool.kernels-core]`` in ``pyproject.toml`` in the working directory. Layers merge key by key, so a higher
layer only overrides what it names; the merged configuration remembers which source gave each key, so that
every message about a value names the file, environment variable or argument it came from.

This module checks shapes and types only; :mod:`kernels_core._config_names` checks the names against what is
installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from ._errors import ConfigError


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


__all__ = ["KernelsConfig", "KindConfig", "env_flag", "load_config"]

ENV_CONFIG = "KERNELS_CORE_CONFIG"
ENV_DISABLE = "KERNELS_CORE_DISABLE"
# Read only to refuse it: it made configuration names strict, which a warnings filter does now.
ENV_STRICT_CONFIG = "KERNELS_CORE_STRICT_CONFIG"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

_TOP_KEYS = frozenset({"disable", "strict", "plugins", "kernels", "kinds"})
_PLUGIN_KEYS = frozenset({"allow", "block"})
_KERNEL_KEYS = frozenset({"disable"})
_KIND_KEYS = frozenset({"prefer", "disable", "strict", "enabled", "options"})


def env_flag(name: str) -> bool | None:
    """Read a boolean environment variable: ``None`` when unset or empty, else its value.

    Accepted, in any case: ``1``, ``true``, ``yes``, ``on`` and ``0``, ``false``, ``no``, ``off``; anything else
    raises :class:`ConfigError` naming the variable, so a typo never silently means "off".

    Example:
        >>> import os
        >>> os.environ["KERNELS_CORE_EXAMPLE_FLAG"] = "On"
        >>> env_flag("KERNELS_CORE_EXAMPLE_FLAG")
        True
        >>> os.environ["KERNELS_CORE_EXAMPLE_FLAG"] = "ture"
        >>> env_flag("KERNELS_CORE_EXAMPLE_FLAG")
        Traceback (most recent call last):
        ...
        kernels_core.ConfigError: environment variable KERNELS_CORE_EXAMPLE_FLAG='ture' is not a boolean; ...
        >>> del os.environ["KERNELS_CORE_EXAMPLE_FLAG"]
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not a boolean; accepted (any case): "
                      f"{', '.join(_TRUE)} / {', '.join(_FALSE)}, or empty for unset")


@dataclass(frozen=True)
class KindConfig:
    """Configuration for one layer kind.

    Args:
        prefer: kernel ids to use, per backend, in order of preference (key ``any`` applies to every backend
            without its own entry). An id that cannot be used where a module runs raises.
        disable: kernel ids or plugin names never to use for this kind.
        strict: raise when a module of this kind that a kernel could serve ends up without one (``None``: the
            top-level ``strict`` decides).
        enabled: ``False`` leaves every module of this kind alone.
        options: kind-specific options passed to the adapter (e.g. ``materialize_logits`` for the loss); the
            kind's :attr:`LayerKind.options <kernels_core.LayerKind>` declares which names and types it reads.
    """

    prefer: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    disable: frozenset[str] = frozenset()
    strict: bool | None = None
    enabled: bool = True
    options: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class KernelsConfig:
    """The merged configuration for one kernelize call.

    Example:
        >>> cfg = KernelsConfig.from_mapping({"kinds": {"rms_norm": {"prefer": {"cpu": ["any.rms_norm.torch"]}}}})
        >>> cfg.kind("rms_norm").prefer["cpu"]
        ('any.rms_norm.torch',)
    """

    disable: bool = False
    strict: bool | None = None
    allow_plugins: frozenset[str] | None = None
    block_plugins: frozenset[str] = frozenset()
    disabled_kernels: frozenset[str] = frozenset()
    kinds: Mapping[str, KindConfig] = field(default_factory=dict)
    sources: tuple[str, ...] = ()
    # Key path (("kinds", "rms_norm", "disable")) -> the source that set it, after merging.
    origins: Mapping[tuple[str, ...], str] = field(default_factory=dict)

    def kind(self, name: str) -> KindConfig:
        return self.kinds.get(name, KindConfig())

    def strict_for(self, kind: str) -> bool:
        """Whether a module of ``kind`` left without a usable kernel raises: the kind's own ``strict``, else the
        global one."""
        kind_strict = self.kind(kind).strict
        return bool(self.strict) if kind_strict is None else kind_strict

    def origin(self, *path: str) -> str:
        """The source that set a key (file path, environment variable or ``config argument``).

        Example:
            >>> KernelsConfig.from_mapping({"kernels": {"disable": ["a.b"]}}).origin("kernels", "disable")
            'config argument'
        """
        found = self.origins.get(tuple(path))
        if found is not None:
            return found
        if self.sources:
            return ", ".join(self.sources)
        return "KernelsConfig object"

    @classmethod
    def from_mapping(cls, data: Mapping[str, object], *, source: str = "config argument") -> KernelsConfig:
        validated = _validated(data, source)
        return _build(validated, (source,), {path: source for path in _paths(validated)})


def _expect(condition: bool, source: str, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{source}: {key}: {message}")


def _str_list(value: object, source: str, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    _expect(
        isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value),
        source, key, f"expected a list of strings, got {value!r}",
    )
    return tuple(value)  # type: ignore[arg-type]


def _bool(value: object, source: str, key: str) -> bool:
    _expect(isinstance(value, bool), source, key, f"expected true or false, got {value!r}")
    return bool(value)


def _unknown(data: Mapping[str, object], allowed: frozenset[str], source: str, where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown} in {where}; allowed: {sorted(allowed)}")


def _validated(data: Mapping[str, object], source: str) -> dict[str, object]:
    """Check shapes and normalise lists into tuples; returns a plain nested dict for merging."""
    _expect(isinstance(data, Mapping), source, "<root>", f"expected a table, got {type(data).__name__}")
    _unknown(data, _TOP_KEYS, source, "the top level")
    out: dict[str, object] = {}
    if "disable" in data:
        out["disable"] = _bool(data["disable"], source, "disable")
    if "strict" in data:
        out["strict"] = _bool(data["strict"], source, "strict")
    if "plugins" in data:
        plugins = data["plugins"]
        _expect(isinstance(plugins, Mapping), source, "plugins", "expected a table with allow/block")
        _unknown(plugins, _PLUGIN_KEYS, source, "[plugins]")
        out["plugins"] = {k: _str_list(v, source, f"plugins.{k}") for k, v in plugins.items()}
    if "kernels" in data:
        kernels = data["kernels"]
        _expect(isinstance(kernels, Mapping), source, "kernels", "expected a table with disable")
        _unknown(kernels, _KERNEL_KEYS, source, "[kernels]")
        out["kernels"] = {k: _str_list(v, source, f"kernels.{k}") for k, v in kernels.items()}
    if "kinds" in data:
        kinds = data["kinds"]
        _expect(isinstance(kinds, Mapping), source, "kinds", "expected a table keyed by layer kind")
        out_kinds: dict[str, dict[str, object]] = {}
        for kind_name, kind_data in kinds.items():
            where = f"kinds.{kind_name}"
            _expect(isinstance(kind_data, Mapping), source, where, "expected a table")
            _unknown(kind_data, _KIND_KEYS, source, f"[{where}]")
            entry: dict[str, object] = {}
            if "prefer" in kind_data:
                prefer = kind_data["prefer"]
                _expect(isinstance(prefer, Mapping), source, f"{where}.prefer", "expected {backend = [ids]}")
                entry["prefer"] = {b: _str_list(ids, source, f"{where}.prefer.{b}") for b, ids in prefer.items()}
            if "disable" in kind_data:
                entry["disable"] = _str_list(kind_data["disable"], source, f"{where}.disable")
            for flag in ("strict", "enabled"):
                if flag in kind_data:
                    entry[flag] = _bool(kind_data[flag], source, f"{where}.{flag}")
            if "options" in kind_data:
                _expect(isinstance(kind_data["options"], Mapping), source, f"{where}.options", "expected a table")
                entry["options"] = dict(kind_data["options"])
            out_kinds[str(kind_name)] = entry
        out["kinds"] = out_kinds
    return out


def _paths(data: Mapping[str, object], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path of a validated layer, tables included (an empty ``[kinds.x]`` table is still named)."""
    paths: list[tuple[str, ...]] = []
    for key, value in data.items():
        path = (*prefix, str(key))
        paths.append(path)
        if isinstance(value, dict):
            paths.extend(_paths(value, path))
    return paths


def _merge(low: dict[str, object], high: dict[str, object]) -> dict[str, object]:
    merged = dict(low)
    for key, value in high.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)  # type: ignore[arg-type]
        else:
            merged[key] = value
    return merged


def _build(data: dict[str, object], sources: tuple[str, ...],
           origins: Mapping[tuple[str, ...], str]) -> KernelsConfig:
    plugins = data.get("plugins", {})
    kinds = {
        name: KindConfig(
            prefer={b: tuple(ids) for b, ids in entry.get("prefer", {}).items()},
            disable=frozenset(entry.get("disable", ())),
            strict=entry.get("strict"),
            enabled=entry.get("enabled", True),
            options=dict(entry.get("options", {})),
        )
        for name, entry in data.get("kinds", {}).items()  # type: ignore[union-attr]
    }
    allow = plugins.get("allow")  # type: ignore[union-attr]
    return KernelsConfig(
        disable=bool(data.get("disable", False)),
        strict=data.get("strict"),  # type: ignore[arg-type]
        allow_plugins=frozenset(allow) if allow is not None else None,
        block_plugins=frozenset(plugins.get("block", ())),  # type: ignore[union-attr]
        disabled_kernels=frozenset(data.get("kernels", {}).get("disable", ())),  # type: ignore[union-attr]
        kinds=kinds,
        sources=sources,
        origins=dict(origins),
    )


def _read_toml(path: Path, *, section: tuple[str, ...] = ()) -> dict[str, object] | None:
    try:
        with path.open("rb") as handle:
            data: object = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {str(path)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    for key in section:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data  # type: ignore[return-value]


def _file_layer(cwd: Path) -> tuple[dict[str, object], str] | None:
    kernels_toml = cwd / "kernels.toml"
    if kernels_toml.is_file():
        data = _read_toml(kernels_toml)
        return (_validated(data or {}, str(kernels_toml)), str(kernels_toml))
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        data = _read_toml(pyproject, section=("tool", "kernels-core"))
        if data is not None:
            source = f"{pyproject} [tool.kernels-core]"
            return (_validated(data, source), source)
    return None


def load_config(config: Mapping[str, object] | str | os.PathLike[str] | KernelsConfig | None = None,
                *, cwd: Path | None = None) -> KernelsConfig:
    """Merge every configuration source for one kernelize call.

    Example:
        >>> load_config({"strict": True}, cwd=Path("/nonexistent")).strict
        True
    """
    if isinstance(config, KernelsConfig):
        return config
    layers: list[tuple[dict[str, object], str]] = []
    found = _file_layer(cwd or Path.cwd())
    if found:
        layers.append(found)
    env_path = os.environ.get(ENV_CONFIG)
    if env_path:
        data = _read_toml(Path(env_path))
        layers.append((_validated(data or {}, f"{ENV_CONFIG}={env_path}"), f"{ENV_CONFIG}={env_path}"))
    if os.environ.get(ENV_STRICT_CONFIG, "").strip():
        raise ConfigError(f"{ENV_STRICT_CONFIG} is no longer read: configuration names that match nothing installed "
                          "always warn with kernels_core.ConfigWarning, and `strict` no longer changes that. Unset "
                          'it; to make those warnings errors, call warnings.filterwarnings("error", '
                          "category=kernels_core.ConfigWarning) (in pytest: filterwarnings = "
                          "error::kernels_core.ConfigWarning)")
    disable = env_flag(ENV_DISABLE)
    if disable is not None:
        layers.append(({"disable": disable}, f"{ENV_DISABLE}={os.environ[ENV_DISABLE].strip()}"))
    if config is not None:
        if isinstance(config, (str, os.PathLike)):
            source = str(config)
            layers.append((_validated(_read_toml(Path(config)) or {}, source), source))
        else:
            layers.append((_validated(config, "config argument"), "config argument"))
    merged: dict[str, object] = {}
    origins: dict[tuple[str, ...], str] = {}
    for data, source in layers:
        merged = _merge(merged, data)
        origins.update((path, source) for path in _paths(data))
    return _build(merged, tuple(source for _data, source in layers), origins)
