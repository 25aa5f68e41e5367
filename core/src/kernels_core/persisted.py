"""What a saved kernelized model holds of kernels-core: kernel ids and a state version, never code references.

Every kernels-core object in a pickled or ``torch.save``d kernelized model (the bound forwards, the binding records
that undo them, the report) pickles as a call of :func:`restore`, the one name pickles reference, with
:data:`STATE_VERSION` and its type name, followed by its fields as plain data. A bound forward names its kernels by
kernel id and layer kind (``cuda.rms_norm.triton``, ``rms_norm``: what the report shows), never by the module
their code lives in, so plugins can reorganise their code without breaking saved models.

Loading looks each kernel id up among the installed plugins (the process-wide plugin manager) and rebuilds the
forward from that kernel's implementation and its kind's adapter. A kernel not installed or not buildable there
does not stop the load. As in kernelize, an automatic choice falls back: the module runs its own forward, with one
:class:`~kernels_core.KernelFallbackWarning` per kernel and cause naming the kernel id and saying to kernelize
again, and :func:`kernels_core.get_report` shows it fell back; a kernel named in ``prefer`` raises
:class:`~kernels_core.KernelizeError` at each call. Models saved by kernels-core 0.1.0 (before the state was
versioned) load the same way. ``copy.deepcopy`` keeps what its original found, without looking kernels up again.

Example:
    >>> import pickle, torch, kernels_core
    >>> model = torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-6))
    >>> model = kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE)
    >>> saved = pickle.dumps(model)
    >>> b"kernels_core.persisted" in saved, b"kernels_core._" in saved, b"any.rms_norm.recompute" in saved
    (True, False, True)
    >>> kernels_core.get_report(pickle.loads(saved)).applied[0].kernel
    'any.rms_norm.recompute'
"""

from __future__ import annotations

import pickle
from typing import Any
from typing import ClassVar

from ._refs import load_ref


__all__ = ["STATE_VERSION", "Persisted", "restore"]

# The version of the fields below; a pickle carries it with every object.
STATE_VERSION = 1

# The type names pickles use, and where each class lives now (free to move: no pickle names the module).
_TYPES = {
    "BindingRecord": "kernels_core._binding:BindingRecord",
    "MISSING": "kernels_core._binding:MISSING",
    "Declared": "kernels_core._forward:Declared",
    "GlobalOverride": "kernels_core._forward:GlobalOverride",
    "KernelForward": "kernels_core._forward:KernelForward",
    "ReroutedForward": "kernels_core._forward:ReroutedForward",
    "KernelizeReport": "kernels_core._report:KernelizeReport",
    "ReportEntry": "kernels_core._report:ReportEntry",
    "Match": "kernels_core._types:Match",
}


def restore(version: int, name: str) -> object:
    """The kernels-core object of type ``name``, empty, for pickle to fill with the fields saved after this call.

    Raises ``pickle.UnpicklingError`` for a state version newer than this kernels-core reads, saying what to do.
    """
    if not isinstance(version, int) or not 1 <= version <= STATE_VERSION or name not in _TYPES:
        raise pickle.UnpicklingError(
            f"this model holds kernels-core state {name!r} of version {version!r}; this kernels-core reads "
            f"versions up to {STATE_VERSION}. Install the kernels-core release that saved it, or call "
            "kernels_core.unkernelize(model) before saving it and kernels_core.kernelize(model) after loading it")
    found = load_ref(_TYPES[name])
    return found if name == "MISSING" else found.__new__(found)


class Persisted:
    """Base of the kernels-core objects a saved model holds: each pickles as :func:`restore` and its fields.

    ``_transient`` names attributes that are rebuilt after a load instead of saved.
    """

    __slots__ = ()
    _transient: ClassVar[frozenset[str]] = frozenset()

    def __reduce__(self) -> tuple[Any, ...]:
        state = {key: value for key, value in self.__dict__.items() if key not in self._transient}
        return restore, (STATE_VERSION, type(self).__name__), state
