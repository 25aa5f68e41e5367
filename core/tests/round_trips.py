"""How a user copies or saves a kernelized model, for the tests of what survives it."""

from __future__ import annotations

import copy
import io
import pickle

import torch


HOWS = ("deepcopy", "pickle", "torch.save")


def round_trip(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """``model`` copied (``deepcopy``) or saved and loaded again (``pickle``, ``torch.save``)."""
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)
