"""Binding: the instance attributes kernelize sets on a module, the record that undoes them exactly, the
transaction (:class:`Changes`) that applies one kernelize call's bindings all or nothing, and the report that call
leaves on the model.

A binding only ever sets instance attributes (the module's ``forward``, or, under accelerate's hooks, its
``_old_forward``), never parameters, buffers or sub-modules, and stores a :class:`BindingRecord` in the module's
``__dict__`` saying what each attribute held before and what kernelize put there. :func:`unbind` puts the previous
values back; :func:`check_untouched` refuses to when other code replaced a bound attribute since (restoring would
silently drop that code's wrapper). :func:`rebind` replaces every binding under a model at once, with its report.

This module alone reads and writes the two attributes kernelize keeps in a module's ``__dict__``: the binding record
(:func:`record_of`) and, on the model kernelize was called on, the report (:func:`stored_report`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING
from typing import Any

from ._errors import KernelizeError
from .persisted import STATE_VERSION
from .persisted import Persisted
from .persisted import restore


if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "BINDING_ATTR",
    "FOREIGN_FORWARD",
    "MISSING",
    "REPORT_ATTR",
    "BindingRecord",
    "Changes",
    "bind",
    "check_untouched",
    "forward_slot",
    "instance_override",
    "instance_overrides",
    "original_forward",
    "rebind",
    "record_of",
    "store_report",
    "stored_report",
    "unbind",
    "unbind_all",
]

BINDING_ATTR = "_kernels_core_binding"
REPORT_ATTR = "_kernels_core_report"
# Why a module whose forward other code replaced per instance is left alone (the report's reason starts so).
FOREIGN_FORWARD = "the instance forward was already replaced by other code"


class _Missing:
    """Marks an instance attribute that did not exist before binding (restored by deleting it). One instance: a
    pickle or a copy names it, and :func:`~kernels_core.persisted.restore` returns it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return restore, (STATE_VERSION, "MISSING")

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


@dataclass
class BindingRecord(Persisted):
    """Stored in a bound module's ``__dict__``: the instance attributes kernelize replaced, and by what.

    ``previous`` holds what each attribute was before binding (``MISSING``: it did not exist), ``bound`` what
    kernelize set it to: an attribute that no longer holds its ``bound`` value was replaced by other code since (a
    wrapper), which restoring ``previous`` would silently drop. ``kernels`` names the (kind, kernel id) pairs bound.
    """

    previous: dict[str, object] = field(default_factory=dict)
    kernels: tuple[tuple[str, str], ...] = ()
    bound: dict[str, object] = field(default_factory=dict)


def record_of(module: nn.Module) -> BindingRecord | None:
    """The record of what kernelize bound to ``module`` itself, or None."""
    return module.__dict__.get(BINDING_ATTR)


def forward_slot(module: nn.Module) -> str:
    """The instance attribute holding the module's own math: ``_old_forward`` where accelerate's
    ``add_hook_to_module`` wrapped the instance, else ``forward``."""
    namespace = module.__dict__
    return "_old_forward" if "_hf_hook" in namespace and "_old_forward" in namespace else "forward"


def instance_override(module: nn.Module) -> object | None:
    """What replaced the class forward on this instance before kernels-core bound anything, or None.

    accelerate's hook partial is not an override (the math is what it calls), and neither is the class forward
    bound to the instance, which is what accelerate stores when it wraps a plain module.
    """
    slot = forward_slot(module)
    record = record_of(module)
    value = record.previous.get(slot) if record is not None and slot in record.previous else module.__dict__.get(slot)
    if value is None or value is MISSING:
        return None
    if getattr(value, "__self__", None) is module and getattr(value, "__func__", None) is type(module).forward:
        return None
    return value


def instance_overrides(model: nn.Module) -> dict[int, object]:
    """:func:`instance_override` of every module under ``model`` that has one, by ``id(module)``."""
    found = ((id(module), instance_override(module)) for module in model.modules())
    return {key: value for key, value in found if value is not None}


def original_forward(module: nn.Module) -> Any:
    """The forward computing the module's math before kernels-core bound anything to it.

    Under accelerate's hooks that is ``_old_forward``: probing it directly skips only the device moves, which a
    probe built on the module's own device does not need.
    """
    slot = forward_slot(module)
    record = record_of(module)
    if record is not None and slot in record.previous:
        previous = record.previous[slot]
        return type(module).forward.__get__(module, type(module)) if previous is MISSING else previous
    return getattr(module, slot)


def _assign(namespace: dict[str, Any], values: dict[str, object]) -> None:
    """Put instance attributes in place; ``MISSING`` means the attribute does not exist and is removed."""
    for attr, value in values.items():
        if value is MISSING:
            namespace.pop(attr, None)
        else:
            namespace[attr] = value


class Changes:
    """The instance attributes one kernelize (or unkernelize) call has set, with what they held.

    As a context manager, a transaction: if the block raises (anything, ``KeyboardInterrupt`` included), every change
    made through it is undone, newest first, before the exception propagates, so the model is exactly as it was.
    """

    def __init__(self) -> None:
        self._undo: list[tuple[dict[str, Any], dict[str, object]]] = []

    def set(self, namespace: dict[str, Any], values: dict[str, object]) -> None:
        """Set ``values`` in ``namespace`` (an instance ``__dict__``; ``MISSING`` deletes), remembering the old."""
        self._undo.append((namespace, {attr: namespace.get(attr, MISSING) for attr in values}))
        _assign(namespace, values)

    def __enter__(self) -> Changes:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            for namespace, previous in reversed(self._undo):
                _assign(namespace, previous)


def bind(changes: Changes, module: nn.Module, attributes: dict[str, object],
         kernels: tuple[tuple[str, str], ...]) -> None:
    """Set ``attributes`` on ``module`` and record what they replace; ``forward`` means the module's forward slot.

    Under accelerate's hooks the module's math lives in ``_old_forward``, which the hook calls after moving the
    inputs: a kernel goes there, so the hooks keep running around it and unkernelize gives them back intact.
    """
    slot = forward_slot(module)
    attributes = {(slot if attr == "forward" else attr): value for attr, value in attributes.items()}
    clash = sorted(set(attributes) & (set(module._parameters) | set(module._buffers) | set(module._modules)))
    if clash:
        raise KernelizeError(f"binding would overwrite parameters/buffers/sub-modules {clash} of "
                             f"{type(module).__name__}")
    previous = {attr: module.__dict__.get(attr, MISSING) for attr in attributes}
    record = BindingRecord(previous=previous, kernels=kernels, bound=dict(attributes))
    changes.set(module.__dict__, {**attributes, BINDING_ATTR: record})


def unbind(changes: Changes, module: nn.Module) -> bool:
    """Put back what kernelize replaced on ``module`` and drop its record; False if it had none."""
    record = record_of(module)
    if record is None:
        return False
    changes.set(module.__dict__, {**record.previous, BINDING_ATTR: MISSING})
    return True


def _describe(value: object) -> str:
    if value is MISSING:
        return "nothing (the attribute was deleted)"
    fn = getattr(value, "__func__", value)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    where = getattr(fn, "__module__", None)
    return f"{name} from {where}" if where else name


def check_untouched(model: nn.Module, action: str) -> None:
    """Raise, changing nothing, if other code replaced an attribute kernelize bound somewhere in ``model``.

    Restoring the attribute would silently drop that code's wrapper (accelerate's autocast, TRL's fused head).
    """
    changed: list[str] = []
    for name, module in model.named_modules():
        record = record_of(module)
        for attr, value in (record.bound if record is not None else {}).items():
            current = module.__dict__.get(attr, MISSING)
            if current is not value:
                changed.append(f"module {name or '(model)'!r} ({type(module).__qualname__}).{attr} was set to "
                               f"{value!r} by kernelize and is now {_describe(current)}")
    if changed:
        raise KernelizeError(
            f"{action} would drop code that wrapped the model after kernelize: {'; '.join(changed)}. Nothing was "
            f"changed. {action.capitalize()} before that code wraps the model (for accelerate and TRL: before "
            "Accelerator.prepare / building the trainer), or undo that wrapper first")


def rebind(model: nn.Module, report: Any,
           bindings: Iterable[tuple[nn.Module, dict[str, object], tuple[tuple[str, str], ...]]] | None) -> None:
    """Replace every binding under ``model`` with ``bindings`` and leave ``report`` on it, all or nothing.

    ``bindings`` gives, module by module, the attributes to set and the (kind, kernel id) pairs they bind; it is
    read inside the transaction, after every earlier binding under ``model`` was undone, so that whatever raises
    while making one (a plugin's bind hook) leaves the model exactly as it was. A sub-module kernelized on its own
    before (the model inside a PEFT or accelerate wrapper) loses its report with its bindings. None (kernelize
    disabled by configuration) changes no binding: the report alone is left.
    """
    if bindings is None:
        store_report(model, report)
        return
    with Changes() as changes:
        for module in model.modules():
            unbind(changes, module)
        for module, attributes, kernels in bindings:
            bind(changes, module, attributes, kernels)
        changes.set(model.__dict__, {REPORT_ATTR: report})
    _drop_reports(model, keep_root=True)


def unbind_all(model: nn.Module) -> int:
    """Undo every binding under ``model`` (a wrapper's too) and drop every report there; how many modules were bound.

    Raises :class:`KernelizeError`, changing nothing, where other code replaced a bound attribute since.
    """
    check_untouched(model, "unkernelize")
    changes = Changes()
    restored = sum(unbind(changes, module) for module in model.modules())
    _drop_reports(model, keep_root=False)
    return restored


def stored_report(model: nn.Module) -> Any:
    """The report the last kernelize call left on ``model``, as it was written (None: none)."""
    return model.__dict__.get(REPORT_ATTR)


def store_report(model: nn.Module, report: Any) -> None:
    """Leave ``report`` on ``model`` in place of the one there (an integration noting what it saw about the model,
    the Trainer callback)."""
    model.__dict__[REPORT_ATTR] = report


def _drop_reports(model: nn.Module, *, keep_root: bool) -> None:
    for module in model.modules():
        if not (keep_root and module is model):
            module.__dict__.pop(REPORT_ATTR, None)
