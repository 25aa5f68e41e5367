"""DeepSpeed ZeRO-3: gathering partitioned parameters for the probes, and kernels that read a child's weight.

ZeRO-3 (``deepspeed.zero.Init`` while the model loads, or ``deepspeed.initialize``) keeps each rank's slice of a
parameter in ``param.ds_tensor`` and replaces ``param.data`` with an empty tensor. Such a parameter carries
``ds_id``, its full shape in ``ds_shape`` and, in ``ds_status``, whether the whole tensor is there right now
(``AVAILABLE``, ``NOT_AVAILABLE``, or ``INFLIGHT`` while a prefetch runs); DeepSpeed attaches ``all_gather`` and
``partition`` methods to it. Once the engine is built, every module carries DeepSpeed's hooks: a forward pre-hook
gathers the module's own parameters and a forward hook releases them, and two more wrap the module's inputs and
outputs in autograd functions that gather them again before the module's backward and release them after it.
The second gather matters: autograd accumulates a weight's gradient into the parameter, whose data must then have
the full shape, and DeepSpeed's post-accumulate-grad hook reduce-scatters it into the rank's partition.

Two kinds read a child module's weight without calling the child: ``causal_lm_loss`` (``lm_head.weight``) and
``residual_rms_norm`` (``post_attention_layernorm.weight``). Where the child carries DeepSpeed's hooks, the kernel
runs between them (:func:`enter_forward`, :func:`exit_forward`), as calling the child would: the weight is
gathered for the kernel's forward and released after it, gathered again for its backward, and its gradient takes
DeepSpeed's own reduce path. A partitioned weight is never computed on otherwise: where the child also carries
hooks of another origin (DeepSpeed's flops profiler, user hooks), or nothing gathers the weight, the adapter calls
the child itself.

Nothing here imports deepspeed: the parameters carry what is needed.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


__all__ = ["DIRECT", "HOOKS", "MODULE", "ParametersInFlight", "access", "enter_forward", "exit_forward", "full_shape",
           "gathered", "hooks_problem", "is_partitioned", "require_whole"]

# How a kernel may read a child module's weight without calling the child (see ``access``).
DIRECT = "direct"  # read it: no hooks, and the weight is whole
HOOKS = "hooks"  # run the child's DeepSpeed hooks around the kernel, then read it
MODULE = "module"  # do not: call the child module (its hooks do something else, or nothing gathers the weight)

# DeepSpeed's ZeRO-3 module hooks are closures defined in this method of DeepSpeedZeRoOffload
# (deepspeed.runtime.zero.parameter_offload); its NVTX decorator wraps some of them without functools.wraps.
_HOOK_FACTORY = "_register_deepspeed_module.<locals>."


class ParametersInFlight(RuntimeError):
    """A probe needs parameters DeepSpeed is fetching right now: the module is declined with this reason (no fault of
    the plugin whose matcher asked)."""


def is_partitioned(tensor: object) -> bool:
    """Whether ``tensor`` is a ZeRO-3 parameter (gathered right now or not)."""
    return hasattr(tensor, "ds_id")


def full_shape(tensor: torch.Tensor) -> torch.Size:
    """The parameter's whole shape: ``ds_shape`` for a ZeRO-3 parameter (its data may be empty), else its shape."""
    shape = getattr(tensor, "ds_shape", None)
    return torch.Size(shape) if shape is not None else tensor.shape


def _status(tensor: object) -> str | None:
    status = getattr(tensor, "ds_status", None)
    return None if status is None else str(getattr(status, "name", status))


def _whole(tensor: object) -> bool:
    return _status(tensor) in (None, "AVAILABLE")


def require_whole(tensor: torch.Tensor | None, what: str) -> None:
    """Raise rather than let a kernel compute on a ZeRO-3 partition (an empty tensor) of ``what``."""
    if tensor is None or not is_partitioned(tensor):
        return
    if not _whole(tensor) or tensor.shape != full_shape(tensor):
        raise RuntimeError(f"{what} is a DeepSpeed ZeRO-3 parameter that is not gathered (ds_status "
                           f"{_status(tensor)}, data shape {tuple(tensor.shape)} of {tuple(full_shape(tensor))}); "
                           "the kernel would compute on an empty partition")


def _function_inside(fn: Any) -> Any:
    """The function a decorator wraps: ``__wrapped__``, or the only function in its closure."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        return inner
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(value):
            found.append(value)
    return found[0] if len(found) == 1 else None


def _is_deepspeed_hook(hook: Any) -> bool:
    fn = hook
    for _ in range(4):
        if fn is None:
            return False
        if str(getattr(fn, "__module__", "")).startswith("deepspeed.") and _HOOK_FACTORY in str(
                getattr(fn, "__qualname__", "")):
            return True
        fn = _function_inside(fn)
    return False


def _describe(hook: Any) -> str:
    return str(getattr(hook, "__qualname__", None) or type(hook).__qualname__)


def hooks_problem(module: nn.Module) -> str | None:
    """None if every forward hook of ``module`` is one of DeepSpeed ZeRO-3's parameter hooks (or it has none); else
    which hook is not, for the report."""
    if module._forward_pre_hooks_with_kwargs or module._forward_hooks_with_kwargs:
        return "forward hooks taking keyword arguments"
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for hook in hooks.values():
            if not _is_deepspeed_hook(hook):
                return f"forward hook {_describe(hook)}"
    return None


def access(module: nn.Module, weight: torch.Tensor | None) -> str:
    """How a kernel may read ``module``'s ``weight`` (read from ``module._parameters``) without calling ``module``:
    ``HOOKS`` (between DeepSpeed's hooks of ``module``: it has those and no others), ``DIRECT`` (the weight is whole)
    or ``MODULE`` (a partitioned weight that only calling ``module`` gathers, through hooks of other origin too)."""
    if (module._forward_pre_hooks or module._forward_hooks) and hooks_problem(module) is None:
        return HOOKS
    # Hooks of other origin were checked when kernelize matched; a ZeRO-3 weight is whole without DeepSpeed's hooks
    # only where something else gathered it (a z3 leaf ancestor's hooks, a probe).
    return DIRECT if weight is None or _whole(weight) else MODULE


def enter_forward(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Run ``module``'s forward pre-hooks on ``args`` as ``module(*args)`` would, and return the arguments they
    hand on (DeepSpeed's gather the module's parameters and route the inputs through its post-backward function)."""
    for hook in tuple(module._forward_pre_hooks.values()):
        result = hook(module, args)
        if result is not None:
            args = result if isinstance(result, tuple) else (result,)
    return args


def exit_forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Run ``module``'s forward hooks on ``output`` as ``module(*args)`` would, and return the output they hand on
    (DeepSpeed's release the module's parameters and route the output through its pre-backward function)."""
    for hook in tuple(module._forward_hooks.values()):
        result = hook(module, args, output)
        if result is not None:
            output = result
    return output


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """Within this block ``module``'s ZeRO-3 parameters (all of them, recursively) are whole; those gathered here are
    partitioned again after. A no-op for other parameters.

    The gather is a collective: every rank must enter this block for the same modules in the same order, as it
    does when every rank kernelizes the same model.
    """
    params = [p for p in module.parameters() if is_partitioned(p) and not _whole(p)]
    if not params:
        yield
        return
    busy = sorted({str(_status(p)) for p in params} - {"NOT_AVAILABLE"})
    if busy:
        raise ParametersInFlight(f"DeepSpeed ZeRO-3 parameters of {type(module).__name__} are being fetched "
                                 f"(ds_status {', '.join(busy)}); they cannot be gathered for a probe now")
    params.sort(key=lambda p: p.ds_id)  # the same order on every rank
    params[0].all_gather(param_list=params)
    try:
        yield
    finally:
        # Only what is still whole and used by no running module: DeepSpeed's own hooks may have released some (a
        # probe calls sub-modules), and partitioning a parameter a module holds would raise.
        done = [p for p in params if _whole(p) and not getattr(p, "ds_active_sub_modules", None)]
        if done:
            done[0].partition(param_list=done)
