"""Launching this package's Triton kernels with little host work, and the host-side integer helpers they use.

Importing this module imports Triton; the op modules import it, and adapters import those lazily (GPU tensors).
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable

import torch
import triton


__all__ = ["FLOATS", "Compiled", "Launcher", "cdiv", "launch_hooks_registered", "next_power_of_2", "sm_count"]

# The dtypes this package's kernels take.
FLOATS = (torch.float16, torch.bfloat16, torch.float32)

logger = logging.getLogger(__name__)


class Launcher:
    """Launch one ``@triton.jit`` kernel with less host work than ``kernel[grid](...)``.

    ``kernel[grid](...)`` binds and specialises every argument, builds a cache key from them and reads several
    settings on each call: tens of microseconds, which is the whole GPU time of a 16M-element RMSNorm. The
    kernels here declare every integer argument ``do_not_specialize``, so a compiled kernel depends only on the
    constexpr values, the tensor dtypes, the 16-byte alignment of each tensor and whether an integer needs 64
    bits. This class keys compiled kernels on exactly that (read cheaply), compiles through the normal launch on
    a miss, and otherwise launches the cached compiled kernel directly. Under Triton's interpreter, or if the
    direct launch ever fails, it uses the normal launch from then on.
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, Compiled] = {}
        params = getattr(kernel, "params", None)  # absent under the interpreter
        self.direct = params is not None and os.environ.get("KERNELS_TRITON_DIRECT_LAUNCH", "1") != "0"
        # Per parameter: how its argument enters the key. Constexprs and integers Triton may specialise on their
        # value are keyed by value; unspecialised integers only by whether they fit 32 bits.
        self.by_value = tuple(p.is_constexpr or not p.do_not_specialize for p in params or ())
        self._pickers: tuple[Callable[[tuple], tuple], ...] | None = None

    def _plan(self, args: tuple) -> tuple[Callable[[tuple], tuple], ...]:
        """Pickers of the tensor, value-keyed and unspecialised-integer arguments, from one call's arguments.

        Every call site passes the same kind of argument at each position, so where each kind sits is worked out
        once; floats are never specialised and stay out of the key.
        """
        tensors, values, integers = [], [], []
        for index, (by_value, arg) in enumerate(zip(self.by_value, args, strict=True)):
            if isinstance(arg, torch.Tensor):
                tensors.append(index)
            elif by_value or isinstance(arg, bool):
                values.append(index)
            elif isinstance(arg, int):
                integers.append(index)
        return tuple(_picker(positions) for positions in (tensors, values, integers))

    def _key(self, args: tuple) -> tuple:
        # Runs on every call: tensors by dtype and 16-byte alignment, value-keyed arguments by value,
        # unspecialised integers by whether they fit 32 bits.
        if self._pickers is None:
            self._pickers = self._plan(args)
        tensors, values, integers = self._pickers
        return (tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors(args)]), values(args),
                tuple([-(2**31) <= i < 2**31 for i in integers(args)]))

    def __call__(self, grid: int, *args: object, num_warps: int) -> None:
        if not self.direct:
            self.kernel[(grid,)](*args, num_warps=num_warps)
            return
        # Compiled kernels are loaded per device: the device (current, set by the adapters to the inputs') is
        # part of the key, like the per-device caches of Triton's own launch.
        device = args[0].get_device()
        key = (num_warps, device, self._key(args))
        entry = self.compiled.get(key)
        if entry is None:
            compiled = self.kernel[(grid,)](*args, num_warps=num_warps)
            try:
                self.compiled[key] = Compiled(compiled)
            except AttributeError:  # a Triton without these attributes: its normal launch from now on
                logger.warning("kernels-triton: cannot launch %s directly with this Triton; using its normal "
                               "launch", self.kernel.__name__, exc_info=True)
                self.direct = False
            return
        try:
            entry.launch(grid, device, args)
        except Exception:  # noqa: BLE001 - an unexpected Triton API: the normal launch always works
            logger.warning("kernels-triton: direct launch of %s failed; using Triton's normal launch from now on",
                           self.kernel.__name__, exc_info=True)
            self.direct = False
            self.kernel[(grid,)](*args, num_warps=num_warps)


try:
    from triton import knobs as _knobs
except ImportError:
    _knobs = None
# Triton's runtime settings, which hold the launch hooks (Triton 3.4+), or None.
_RUNTIME = getattr(_knobs, "runtime", None)


class Compiled:
    """One compiled kernel and what its launch needs, read once.

    ``compiled[grid](*args)`` looks up the current device and stream through Triton's driver and builds launch
    metadata for the hooks on every call (H200: 8.7 us of host time per launch that way, 6.7 directly). With no
    launch hook registered this calls the compiled kernel's launcher directly with the tensor's device's current
    stream, the stream Triton itself would use; with hooks (a profiler) it takes Triton's own path so that they
    still run.
    """

    __slots__ = ("compiled", "function", "metadata", "run")

    def __init__(self, compiled: object) -> None:
        self.compiled = compiled
        self.run = compiled.run  # type: ignore[attr-defined]  # loads the binary and builds the launcher once
        self.function = compiled.function  # type: ignore[attr-defined]
        self.metadata = compiled.packed_metadata  # type: ignore[attr-defined]

    def launch(self, grid: int, device: int, args: tuple) -> None:
        if not launch_hooks_registered():
            self.run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device), self.function, self.metadata,
                     None, None, None, *args)
            return
        self.compiled[(grid, 1, 1)](*args)  # type: ignore[index]


def launch_hooks_registered() -> bool:
    """Whether a Triton launch hook (a profiler) is registered: launches must then take Triton's own path."""
    if _RUNTIME is None:
        return True  # a Triton without the runtime knobs: no way to tell, so assume hooks
    # Each hook is a chain of callables (Triton 3.5+), a callable or None: no hook when all are empty.
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook  # type: ignore[attr-defined]
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def _picker(positions: list[int]) -> Callable[[tuple], tuple]:
    """A C-speed ``args -> tuple(args[i] for i in positions)``."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        position = positions[0]
        return lambda args: (args[position],)
    return operator.itemgetter(*positions)


def cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: since Triton 3.5 that is a constexpr function, and called on the host it unwraps its
    # arguments and runs an import on every call (microseconds each, several per launch).
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side ``triton.next_power_of_2`` without its per-call overhead (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=64)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
