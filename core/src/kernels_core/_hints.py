"""The closest-name hint that error messages about an unknown name append.

Example:
    >>> did_you_mean("portabel", ["builtin", "portable"])
    " (did you mean 'portable'?)"
    >>> did_you_mean("xyz", ["builtin"])
    ''
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


__all__ = ["did_you_mean"]


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'closest'?)"`` for the closest candidate (difflib's default cutoff), else ``""``."""
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
