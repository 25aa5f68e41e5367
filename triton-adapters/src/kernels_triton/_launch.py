"""Host-side helpers of this package's Triton kernels: integer arithmetic without Triton's per-call overhead, the
SM count, and whether a Triton launch hook is registered.

Importing this module imports Triton (its runtime settings, if present); it starts nothing. The op modules import
it; Triton's runtime set-up on a background thread (:mod:`kernels_triton._warmup`) starts when kernelize binds one of
their kernels through :mod:`kernels_triton.ops`.
"""

from __future__ import annotations

import functools

import torch


__all__ = ["FLOATS", "cdiv", "launch_hooks_registered", "next_power_of_2", "sm_count"]

# The dtypes this package's kernels take.
FLOATS = (torch.float16, torch.bfloat16, torch.float32)

try:
    from triton import knobs as _knobs
except ImportError:
    _knobs = None
# Triton's runtime settings, which hold the launch hooks (Triton 3.4+), or None.
_RUNTIME = getattr(_knobs, "runtime", None)


def launch_hooks_registered() -> bool:
    """Whether a Triton launch hook (a profiler) is registered: the C++ nodes then leave launches to Triton."""
    if _RUNTIME is None:
        return True  # a Triton without the runtime knobs: no way to tell, so assume hooks
    # Each hook is a chain of callables (Triton 3.5+), a callable or None: no hook when all are empty.
    enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook  # type: ignore[attr-defined]
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


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
