"""Lazy references: the ``package.module:attr.path`` strings by which plugins name matchers, adapters and kernels,
so that listing plugins imports no kernel code. The core loads every one through :func:`load_ref`;
:func:`locate_problem` checks one without running any code.

Example:
    >>> load_ref("json:dumps")([1])
    '[1]'
"""

from __future__ import annotations

import pkgutil
import sys
from typing import Any


__all__ = ["load_ref", "locate_problem", "ref_problem"]


def load_ref(ref: str) -> Any:
    """Import ``package.module`` of ``package.module:attr.path`` and return the attribute.

    Imported modules stay in ``sys.modules``, so a second load costs a dictionary lookup per name.
    """
    return pkgutil.resolve_name(ref)


def ref_problem(ref: str) -> str | None:
    """Why ``ref`` cannot be loaded (imported, resolved, callable), or None; importing it if needed.

    Example:
        >>> ref_problem("json:dumps") is None
        True
        >>> ref_problem("json:no_such_function")
        "cannot be loaded: AttributeError: module 'json' has no attribute 'no_such_function'"
    """
    try:
        obj = load_ref(ref)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return f"cannot be loaded: {type(exc).__name__}: {exc}"
    return None if callable(obj) else f"is not callable ({type(obj).__name__})"


def _find_spec(name: str, path: Any) -> Any:
    # The import system's finders, asked without executing anything (editable installs use meta-path finders).
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(name, path)
        except Exception:  # noqa: BLE001 - a finder that cannot answer is no evidence either way
            continue
        if spec is not None:
            return spec
    return None


def locate_problem(ref: str) -> str | None:
    """Why the module of ``ref`` cannot be found, importing nothing that is not imported yet; None if found.

    Only an attribute of an already imported module is checked; otherwise finding the file is enough.

    Example:
        >>> locate_problem("json:dumps") is None
        True
        >>> locate_problem("no_such_package_xyz.ops:f")
        "module 'no_such_package_xyz' not found"
    """
    module_name, _, attr_path = ref.partition(":")
    parts = module_name.split(".")
    path = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        module = sys.modules.get(name)
        if module is not None:
            path = getattr(module, "__path__", None)
        else:
            spec = _find_spec(name, path)
            if spec is None:
                return f"module {name!r} not found"
            path = spec.submodule_search_locations
        if path is None and i < len(parts) - 1:
            return f"module {'.'.join(parts[: i + 2])!r} not found ({name!r} is not a package)"
    module = sys.modules.get(module_name)
    if module is not None:
        obj: object = module
        for part in attr_path.split("."):
            if not hasattr(obj, part):
                return f"module {module_name!r} has no attribute {attr_path!r}"
            obj = getattr(obj, part)
    return None
