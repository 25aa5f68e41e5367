"""Every error and warning kernels-core raises or issues.

Users catch and filter the public ones as ``kernels_core.<Name>``, so that is the name tracebacks and warnings show
(``__module__``), never the private module that defines them.

Example:
    >>> raise KernelizeError("the model is unchanged")
    Traceback (most recent call last):
    ...
    kernels_core.KernelizeError: the model is unchanged
"""

from __future__ import annotations


__all__ = ["CheckError", "ConfigError", "ConfigWarning", "KernelFallbackWarning", "KernelizeError", "PluginError"]


class ConfigError(ValueError):
    """A configuration value is malformed; the message names the source, the key and the allowed values."""

    __module__ = "kernels_core"


class ConfigWarning(UserWarning):
    """A configuration name matches nothing installed here (a typo, or a plugin this machine lacks).

    The message names the source and the closest installed names. ``warnings.filterwarnings("error",
    category=kernels_core.ConfigWarning)`` raises it instead; ``strict`` does not (it is about kernels, not names).
    """

    __module__ = "kernels_core"


class KernelizeError(RuntimeError):
    """kernelize could not honour an explicit request; the model was left exactly as it was."""

    __module__ = "kernels_core"


class PluginError(RuntimeError):
    """A plugin could not be loaded or used. Raised only in strict mode; otherwise logged once."""

    __module__ = "kernels_core"

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(message)
        self.plugin = plugin


class KernelFallbackWarning(UserWarning):
    """An automatic choice fell back: a kernel or a layer kind could not be used, so something else runs.

    Issued once per kernel (or kind) and cause in a process; the message names the plugin, its distribution,
    the kernel id and the cause. Turn it into an error with a warnings filter:
    ``warnings.filterwarnings("error", category=kernels_core.KernelFallbackWarning)`` (Python's ``-W`` option
    cannot name it: it is checked before kernels-core is imported).
    """

    __module__ = "kernels_core"


class CheckError(ValueError):
    """``kernels-core check`` (or :func:`kernels_core.testing.assert_conforms`) names a plugin or a kernel that is not
    installed."""
