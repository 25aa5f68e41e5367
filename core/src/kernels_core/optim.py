"""Optimizer steps over FSDP2's sharded parameters without DTensor dispatch.

FSDP2 (``fully_shard``) turns every parameter, gradient and optimizer state into a ``DTensor``. An optimizer
step then goes through DTensor's dispatcher once per foreach operator and parameter list: sharding propagation,
unwrapping and rewrapping of every element. On a small model whose step the host already limits, that costs tens
of milliseconds per step (PyTorch issue #134191 reports AdamW at a third of an FSDP2 step). The arithmetic itself is
the same on every rank's local shard: AdamW, Adam, SGD and the other elementwise optimizers touch each element of a
parameter on its own, and FSDP2's parameters, gradients and states share one placement per parameter.

:func:`step_on_local_shards` makes one optimizer run its ``step`` on the local tensors instead: for the duration
of each step its parameter groups hold the local shards (with the local gradients) and its state the local parts
of the same state tensors, then everything is put back. The same kernels run on the same memory, so the result is
bitwise the step DTensor dispatch computes; the optimizer's ``state_dict`` (and distributed checkpoints) keep seeing
DTensors. Optimizers whose update reduces over a parameter (Adafactor's factored moments, Muon's orthogonalisation,
LBFGS) would compute something else on a shard: they are refused by name.

Example:
    >>> import torch
    >>> from kernels_core.optim import local_shard_problem
    >>> local_shard_problem(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
    'no parameter is a DTensor (FSDP2 shards them; nothing to do)'
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Callable
from typing import Any


__all__ = ["ELEMENTWISE_OPTIMIZERS", "NO_DTENSOR", "LocalShardSteps", "installed_local_shard_steps",
           "local_shard_problem", "restore_step", "step_on_local_shards"]

logger = logging.getLogger("kernels_core.optim")

# torch.optim classes whose update of an element reads only that element of the parameter, its gradient and its
# state (plus scalars): the same update on each shard is the update of the whole. Exact classes, not subclasses:
# a subclass may add a reduction.
ELEMENTWISE_OPTIMIZERS: tuple[str, ...] = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop")
# local_shard_problem's answer for an optimizer with nothing sharded (DDP, one device): not worth a message.
NO_DTENSOR = "no parameter is a DTensor (FSDP2 shards them; nothing to do)"
# Attributes on the optimizer: the installed LocalShardSteps (one per optimizer), and the instance step it shadows.
_ATTRIBUTE = "_kernels_core_local_shards"
_PREVIOUS = "_kernels_core_previous_step"


@dataclasses.dataclass(frozen=True)
class LocalShardSteps:
    """What :func:`step_on_local_shards` installed on one optimizer.

    Attributes:
        optimizer: the class name of the optimizer.
        sharded_parameters: how many of its parameters are DTensors (stepped on their local shards).
        parameters: how many parameters it has in all.
    """

    optimizer: str
    sharded_parameters: int
    parameters: int

    def describe(self) -> str:
        """One line for logs and reports.

        Example:
            >>> LocalShardSteps(optimizer="AdamW", sharded_parameters=310, parameters=310).describe()
            'AdamW steps on local shards (310 of 310 parameters are DTensors)'
        """
        return (f"{self.optimizer} steps on local shards ({self.sharded_parameters} of {self.parameters} "
                f"parameters are DTensors)")


def _inner(optimizer: Any) -> Any:
    """The optimizer that steps: the one inside a wrapper that keeps it as ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer``, the Trainer's optimizer under accelerate)."""
    import torch

    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _params(optimizer: Any) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def local_shard_problem(optimizer: Any) -> str | None:
    """Why ``optimizer`` (or the optimizer a wrapper such as accelerate's keeps as ``.optimizer``) cannot step on
    local shards, or None when it can.

    Example:
        >>> import torch
        >>> local_shard_problem(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))]))
        'LBFGS is not one of the elementwise optimizers (SGD, Adam, AdamW, Adagrad, Adamax, NAdam, RAdam, RMSprop): \
its update may reduce over a parameter, which a shard does not hold whole'
    """
    import torch

    optimizer = _inner(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"{type(optimizer).__name__} is not a torch.optim.Optimizer"
    cls = type(optimizer)
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in ELEMENTWISE_OPTIMIZERS:
        return (f"{cls.__name__} is not one of the elementwise optimizers ({', '.join(ELEMENTWISE_OPTIMIZERS)}): its "
                f"update may reduce over a parameter, which a shard does not hold whole")
    own = vars(optimizer).get("step")
    if own is not None and getattr(optimizer, _ATTRIBUTE, None) is None and not _lr_scheduler_wrapper(own):
        return "its step is already replaced on the instance by other code, which would be bypassed"
    if not torch.distributed.is_available():
        return NO_DTENSOR
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial

    sharded = [p for p in _params(optimizer) if isinstance(p, DTensor)]
    if not sharded:
        return NO_DTENSOR
    for p in sharded:
        if any(isinstance(placement, Partial) for placement in p.placements):
            return f"a parameter has a Partial placement {p.placements}: its local tensor is no part of its value"
    return None


def step_on_local_shards(optimizer: Any) -> LocalShardSteps:
    """Make ``optimizer.step()`` update FSDP2's sharded parameters through their local tensors.

    Call it after ``fully_shard`` and after the optimizer is built (before an LR scheduler wraps it is fine, and so
    is after). A wrapper that keeps the optimizer as ``.optimizer`` (accelerate's ``AcceleratedOptimizer``) may be
    passed: the optimizer inside it is the one changed. Idempotent; :func:`restore_step` undoes it. A step falls
    back to the optimizer's own (DTensor) path, with the same result, when it is given a closure or when a
    parameter with a gradient has no state yet (the first step creates the states as DTensors).

    Raises:
        ValueError: the optimizer cannot step on local shards; the message says why (:func:`local_shard_problem`).

    Example:
        >>> import torch
        >>> step_on_local_shards(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
        Traceback (most recent call last):
        ...
        ValueError: cannot step SGD on local shards: no parameter is a DTensor (FSDP2 shards them; nothing to do)
    """
    optimizer = _inner(optimizer)
    installed = getattr(optimizer, _ATTRIBUTE, None)
    if installed is not None:
        return installed
    problem = local_shard_problem(optimizer)
    if problem is not None:
        raise ValueError(f"cannot step {type(optimizer).__name__} on local shards: {problem}")
    from torch.distributed.tensor import DTensor

    params = _params(optimizer)
    installed = LocalShardSteps(optimizer=type(optimizer).__name__, parameters=len(params),
                                sharded_parameters=sum(isinstance(p, DTensor) for p in params))
    # An instance attribute shadows the class's step; the class's step (with the optimizer's hooks) runs inside.
    # An LR scheduler's wrapper found there only marks the optimizer as stepped, which _local_step does too; it
    # is put back by restore_step.
    setattr(optimizer, _PREVIOUS, vars(optimizer).get("step"))
    optimizer.step = types.MethodType(_local_step, optimizer)
    setattr(optimizer, _ATTRIBUTE, installed)
    logger.info("%s", installed.describe())
    return installed


def restore_step(optimizer: Any) -> bool:
    """Undo :func:`step_on_local_shards`; whether it was installed.

    Example:
        >>> import torch
        >>> restore_step(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
        False
    """
    optimizer = _inner(optimizer)
    if getattr(optimizer, _ATTRIBUTE, None) is None:
        return False
    delattr(optimizer, _ATTRIBUTE)
    previous = vars(optimizer).pop(_PREVIOUS, None)
    if getattr(vars(optimizer).get("step"), "__func__", None) is _local_step:
        if previous is None:
            del optimizer.step
        else:
            optimizer.step = previous
    return True


def installed_local_shard_steps(optimizer: Any) -> LocalShardSteps | None:
    """What :func:`step_on_local_shards` installed on ``optimizer`` (or inside its wrapper), or None."""
    return getattr(_inner(optimizer), _ATTRIBUTE, None)


def _lr_scheduler_wrapper(step: Any) -> bool:
    """Whether ``step`` is the wrapper torch's LR schedulers put on an optimizer to see that it stepped."""
    return getattr(step, "_wrapped_by_lr_sched", False) is True


def _local_step(optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
    # What an LR scheduler's wrapper records (torch.optim.lr_scheduler): the scheduler checks it at its first step.
    optimizer._opt_called = True
    step = type(optimizer).step
    if closure is not None or getattr(optimizer, _ATTRIBUTE, None) is None:
        return step(optimizer, closure)
    swap = _Swap.make(optimizer)
    if swap is None:
        return step(optimizer)
    try:
        return step(optimizer)
    finally:
        swap.restore()


# A scheduler made after step_on_local_shards sees the marker and leaves this step in place.
_local_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


@dataclasses.dataclass
class _Swap:
    """The parameter lists and states a step ran with, to put back."""

    optimizer: Any
    groups: list[list[Any]]
    # (DTensor parameter, its local tensor) for every DTensor parameter swapped in.
    pairs: list[tuple[Any, Any]]

    @classmethod
    def make(cls, optimizer: Any) -> _Swap | None:
        """Swap the local tensors in; None (nothing changed) when this step must take the DTensor path."""
        import torch
        from torch.distributed.tensor import DTensor

        state = optimizer.state
        new_groups: list[list[Any]] = []
        pairs: list[tuple[Any, Any]] = []
        local_states: list[tuple[Any, dict[str, Any]]] = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                params = []
                for p in group["params"]:
                    if not isinstance(p, DTensor):
                        params.append(p)
                        continue
                    grad = p.grad
                    local = p._local_tensor
                    if grad is not None:
                        if p not in state:  # the first step builds this state: let it build DTensors
                            return None
                        if not isinstance(grad, DTensor) or grad.placements != p.placements:
                            return None
                        values = {}
                        for key, value in state[p].items():
                            if isinstance(value, DTensor):
                                if value.placements != p.placements:
                                    return None
                                value = value._local_tensor
                            values[key] = value
                        local_states.append((local, values))
                    pairs.append((p, local))
                    params.append(local)
                new_groups.append(params)
            # Nothing is changed until here: from now on restore() puts everything back.
            swap = cls(optimizer=optimizer, groups=[group["params"] for group in optimizer.param_groups],
                       pairs=pairs)
            try:
                for p, local in pairs:
                    local.grad = None if p.grad is None else p.grad._local_tensor
                for local, values in local_states:
                    state[local] = values
                for group, params in zip(optimizer.param_groups, new_groups, strict=True):
                    group["params"] = params
            except BaseException:
                swap.restore()
                raise
        return swap

    def restore(self) -> None:
        """Parameter lists back; each local state written back into the DTensor state it came from."""
        import torch
        from torch.distributed.tensor import DTensor

        state = self.optimizer.state
        for group, params in zip(self.optimizer.param_groups, self.groups, strict=True):
            group["params"] = params
        with torch.no_grad():
            for p, local in self.pairs:
                local.grad = None
                values = state.pop(local, None)
                if values is None:
                    continue
                mine = state[p]
                for key, value in values.items():
                    old = mine.get(key)
                    if isinstance(old, DTensor):
                        if value is not old._local_tensor:  # replaced rather than updated in place
                            mine[key] = DTensor.from_local(value, old.device_mesh, old.placements, run_check=False,
                                                           shape=old.shape, stride=old.stride())
                    else:
                        mine[key] = value
