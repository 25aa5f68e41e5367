"""The closest-name hint that error messages about an unknown name append.

Example:
    >>> did_you_mean("portabel", ["builtin", "portable"])
    " (did you mean 'portable'?)"
    >>> did_you_mean("xyz", ["builtin"])
    ''
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterable
from pathlib import Path


__all__ = ["did_you_mean", "user_stacklevel"]

_PACKAGE_DIR = str(Path(__file__).parent) + os.sep
# Frames a warning is never attributed to: kernels-core's own, and torch's module call machinery between a user's
# ``model(x)`` and a kernelized forward.
_LIBRARY_DIRS = (_PACKAGE_DIR, str(Path(os.path.dirname(os.__file__)) / "contextlib.py"))


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by the caller of this function that names the nearest frame
    outside kernels-core and torch: the user's call of kernelize, or of the model.

    Example:
        >>> import warnings
        >>> def warn_from_library():
        ...     warnings.warn("kernel passed over", UserWarning, stacklevel=user_stacklevel())
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_from_library()
        >>> caught[0].lineno > 0
        True
    """
    frame = sys._getframe(1)  # the frame that calls warnings.warn
    level = 1
    while frame is not None and _library_frame(frame.f_code.co_filename, frame.f_globals.get("__name__", "")):
        frame = frame.f_back
        level += 1
    return level


def _library_frame(filename: str, module: str) -> bool:
    return (filename.startswith(_PACKAGE_DIR) or module == "torch" or module.startswith("torch.")
            or filename.startswith(_LIBRARY_DIRS[1]))


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'closest'?)"`` for the closest candidate (difflib's default cutoff), else ``""``."""
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
