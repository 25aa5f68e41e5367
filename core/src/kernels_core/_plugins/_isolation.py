"""pluggy's plugin manager, with each plugin's implementation of a declaration hook isolated from the others.

pluggy stops a hook call at the first implementation that raises, which for the declaration hooks would let one
broken plugin hide every other plugin's kernels. :class:`IsolatingPluginManager` wraps each implementation of those
hooks as pluggy calls it: one that raises, or returns something other than a list of the hook's type, gives no
result and is recorded against its plugin, and the call goes on. Everything else is pluggy's: ``tryfirst`` and
``trylast`` order the calls, wrappers (``wrapper=True``) see and may edit the results. Since the core keeps
declarations per plugin, every value that comes back is attributed to the plugin that returned it, or to the
wrapper that added it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Generator
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import pluggy

from .._types import declaring
from ._records import Fault


__all__ = ["IsolatingPluginManager"]

# One logger for the package: what a user configures is `kernels_core`, never a private module.
logger = logging.getLogger("kernels_core")


class _Call:
    """One call of a declaration hook: its faults, and which plugins declared each value that came back."""

    def __init__(self, hook: str, expected: type) -> None:
        self.hook, self.expected = hook, expected
        self.faults: list[Fault] = []
        # id(value) -> the plugins that declared it, in call order (two plugins may return one shared object).
        self.owners: dict[int, list[str]] = {}
        self._alive: list[object] = []  # keeps every value alive during the call, so that no id is reused

    def own(self, plugin: str, values: Iterable[object]) -> None:
        for value in values:
            self._alive.append(value)
            self.owners.setdefault(id(value), []).append(plugin)

    def declared(self, plugin: str, result: object) -> list[object] | None:
        """A plain implementation's result, checked and attributed; None (no result) when it is malformed."""
        what = self.expected.__name__
        if result is None:
            self.faults.append(Fault(plugin, f"hook {self.hook} returned None, so it declares nothing; return a "
                                             f"list of {what} (an empty list when there is nothing to declare)",
                                     soft=True))
            return None
        if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
            self.faults.append(Fault(plugin, f"hook {self.hook} returned {type(result).__name__} {result!r}; expected "
                                             f"a list of {what} (wrap a single value in a list)"))
            return None
        values = list(result)  # a generator's exception is the implementation's: the caller isolates it
        for value in values:
            if not isinstance(value, self.expected):
                self.faults.append(Fault(plugin, f"hook {self.hook} returned {type(value).__name__} {value!r}; "
                                                 f"expected {what}"))
                return None
        self.own(plugin, values)
        return values

    def malformed(self, results: object) -> str | None:
        """Why what a wrapper returned is not a list of lists of the hook's type, or None."""
        if not isinstance(results, list) or not all(isinstance(values, (list, tuple)) for values in results):
            return (f"hook wrapper {self.hook} returned {type(results).__name__}; a wrapper returns the list of "
                    "lists it was sent at its yield, edited or not")
        for values in results:
            for value in values:
                if not isinstance(value, self.expected):
                    return (f"hook wrapper {self.hook} returned {type(value).__name__} {value!r} among the results; "
                            f"expected {self.expected.__name__}")
        return None


def _isolated(impl: pluggy.HookImpl, call: _Call) -> pluggy.HookImpl:
    if impl.hookwrapper:  # old-style wrappers are refused at registration
        return impl
    function, plugin = impl.function, impl.plugin_name

    @functools.wraps(function)
    def plain(*args: Any, **kwargs: Any) -> list[object] | None:
        try:
            # A malformed KernelSpec built here is marked, not raised: the loader rejects that kernel alone.
            with declaring():
                result = function(*args, **kwargs)
                return call.declared(plugin, result)
        except Exception as exc:  # noqa: BLE001 - one plugin's failure must not stop the others'
            call.faults.append(Fault(plugin, f"hook {call.hook} raised {type(exc).__name__}: {exc}", exc))
            logger.debug("kernels-core plugin %r: hook %s raised", plugin, call.hook, exc_info=exc)
            return None

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Generator[None, list[list[object]], list[list[object]]]:
        try:
            inner = function(*args, **kwargs)
            next(inner)
        except Exception as exc:  # noqa: BLE001 - raised before its yield, or did not yield at all
            call.faults.append(Fault(plugin, f"hook wrapper {call.hook} raised {type(exc).__name__} before its "
                                             f"yield: {exc}", exc))
            return (yield)
        results = yield
        before = Counter(id(value) for values in results for value in values)
        try:
            inner.send(results)
        except StopIteration as stop:
            edited = stop.value
        except Exception as exc:  # noqa: BLE001 - the results it was sent stand
            call.faults.append(Fault(plugin, f"hook wrapper {call.hook} raised {type(exc).__name__}: {exc}", exc))
            return results
        else:
            inner.close()
            call.faults.append(Fault(plugin, f"hook wrapper {call.hook} yielded more than once"))
            return results
        problem = call.malformed(edited)
        if problem is not None:
            call.faults.append(Fault(plugin, problem))
            return results
        after = Counter(id(value) for values in edited for value in values)
        added = {id(value): value for values in edited for value in values if after[id(value)] > before[id(value)]}
        for key, value in added.items():
            call.own(plugin, [value] * (after[key] - before[key]))
        return edited

    return pluggy.HookImpl(impl.plugin, plugin, wrapper if impl.wrapper else plain, impl.opts)


class IsolatingPluginManager(pluggy.PluginManager):
    """A pluggy ``PluginManager`` whose declaration hooks (``declarations``: hook name -> the type of the values
    their lists hold) isolate each implementation. Call them with :meth:`declare`; other hooks are pluggy's own."""

    def __init__(self, project_name: str, declarations: Mapping[str, type]) -> None:
        super().__init__(project_name)
        self._declarations = dict(declarations)
        self._current = threading.local()

    def declare(self, hook: str) -> tuple[list[tuple[str, object]], list[Fault]]:
        """Call declaration hook ``hook`` through pluggy: ``(plugin, value)`` pairs in the order the values came back,
        and the faults of the implementations that gave no result."""
        call = _Call(hook, self._declarations[hook])
        previous, self._current.call = getattr(self._current, "call", None), call
        try:
            results = getattr(self.hook, hook)()
        finally:
            self._current.call = previous
        pairs = [(owners.pop(0), value) for values in results for value in values
                 if (owners := call.owners.get(id(value)))]
        return pairs, call.faults

    def _hookexec(self, hook_name: str, methods: Sequence[pluggy.HookImpl], kwargs: Mapping[str, object],
                  firstresult: bool) -> object | list[object]:
        expected = self._declarations.get(hook_name)
        if expected is None:
            return super()._hookexec(hook_name, methods, kwargs, firstresult)
        call = getattr(self._current, "call", None)
        direct = call is None or call.hook != hook_name  # pm.hook.<name>() called directly: isolated, faults logged
        call = _Call(hook_name, expected) if direct else call
        results = super()._hookexec(hook_name, [_isolated(impl, call) for impl in methods], kwargs, firstresult)
        for fault in call.faults if direct else ():
            logger.warning("kernels-core plugin %r: %s", fault.plugin, fault.problem)
        return results
