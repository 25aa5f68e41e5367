"""Rerouted forwards: decorator chains re-created around the rerouted copy, or refused with the reason."""

from __future__ import annotations

import functools

from kernels_core._forward import _rewrap
from kernels_core._forward import decorator_chain_problem


def _counting(log: list):
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            log.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def test_a_wraps_chain_is_rebuilt_around_the_new_function_and_keeps_running():
    log: list = []

    @_counting(log)
    @_counting(log)
    def original(x):
        return x + 1

    def replacement(x):
        return x * 10

    assert decorator_chain_problem(original) is None
    rebuilt = _rewrap(original, replacement)
    # Both wrappers ran; the innermost one now calls the replacement.
    assert rebuilt(2) == 20 and len(log) == 2 and log[-1] == "replacement"
    # The original chain is untouched.
    assert original(2) == 3


def test_a_wrapper_holding_the_function_elsewhere_is_refused_by_name():
    def original(x):
        return x

    class Holder:
        fn = staticmethod(original)

    def opaque(*args):
        return Holder.fn(*args)

    opaque.__wrapped__ = original
    problem = decorator_chain_problem(opaque)
    assert problem is not None and "opaque" in problem and "closure cell" in problem


def test_a_non_function_forward_is_refused():
    assert decorator_chain_problem(functools.partial(print)) == "the class forward is not a plain Python function"
