"""Lazy references: the ``package.module:attr.path`` strings by which plugins name matchers, adapters and kernels,
so that listing plugins imports no kernel code. The core loads every one through :func:`load_ref`;
:func:`locate_problem` checks one without running any code.

Example:
    >>> load_ref("json:dumps")([1])
    '[1]'
"""

from __future__ import annotations

import ast
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

    The attribute of an already imported module is looked up; a module not imported yet has its source read (not
    run) for a top-level definition, assignment or import of the attribute's first name.

    Example:
        >>> locate_problem("json:dumps") is None
        True
        >>> locate_problem("no_such_package_xyz.ops:f")
        "module 'no_such_package_xyz' not found"
    """
    module_name, _, attr_path = ref.partition(":")
    parts = module_name.split(".")
    path = None
    spec = None
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
    origin = getattr(spec, "origin", None) if spec is not None else None
    first = attr_path.split(".")[0]
    names = _top_level_names(origin) if isinstance(origin, str) and origin.endswith(".py") else None
    if names is not None and first not in names:
        return f"module {module_name!r} has no attribute {first!r} (its source defines, assigns or imports none)"
    return None


def _top_level_names(path: str) -> set[str] | None:
    """The names a module's source binds at top level; None where that cannot be known without running it (a
    module ``__getattr__``, a star import, unreadable source)."""
    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("globals", "setattr", "exec"):
            return None  # names bound dynamically
    return None if "__getattr__" in names else names
