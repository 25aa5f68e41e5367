"""A stand-in for DeepSpeed ZeRO-3 in one process, for tests that must run where deepspeed is not installed.

It does to a model what ZeRO-3 does, as far as kernels-core can see it:

- :func:`partition` is what ``deepspeed.zero.Init`` leaves: every parameter's data replaced by an empty tensor, its
  slice (here, on a world of one rank, all of it) kept in ``ds_tensor``, the ``ds_*`` attributes set
  (``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_status``, ``ds_persist``, ``ds_active_sub_modules``), and the
  ``all_gather`` / ``partition`` methods attached to each parameter.
- :class:`Engine` is what ``deepspeed.initialize`` adds: on every module, the four hooks DeepSpeed's
  ``_register_deepspeed_module`` registers (gather the module's own parameters before its forward, release them
  after; gather them again before its backward, release them after), and on every parameter a post-accumulate-grad
  hook that takes the gradient away (DeepSpeed reduce-scatters it into the partition) and leaves ``param.grad``
  None. Like the real functions, the hooks are closures of a method named ``_register_deepspeed_module`` in a
  module under ``deepspeed.``, and one is wrapped by an NVTX-style decorator without ``functools.wraps``: that is
  how kernels-core recognises DeepSpeed's hooks.
- :class:`GatheredParameters` gathers parameters for a block and partitions them again after (``modifier_rank=None``).

What it leaves out: DeepSpeed's engine also turns, inside ``engine.forward`` only, every module's parameter dict
into one that gathers a partitioned parameter when code reads it and registers it on the running module (an
"external parameter"). The stand-in has no such help, so it is the stricter setting (a module called outside the
engine's forward, generation for one); the real-DeepSpeed tests cover the engine's forward.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_DEEPSPEED_MODULE = "deepspeed.runtime.zero.parameter_offload"


class Stats:
    """What happened to the parameters: gathers per parameter name, and whether a gather found nothing to gather."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.gathers: dict[str, int] = {}

    def gathered(self, param: nn.Parameter) -> None:
        name = self.names.get(param.ds_id, str(param.ds_id))
        self.gathers[name] = self.gathers.get(name, 0) + 1


def _all_gather(owner: nn.Parameter, param_list: list[nn.Parameter] | None = None, async_op: bool = False,
                hierarchy: int = 0) -> None:
    for param in param_list if param_list is not None else [owner]:
        if param.ds_status is ZeroParamStatus.INFLIGHT:
            raise AssertionError(f"parameter {param.ds_id} is in flight")
        if param.ds_status is ZeroParamStatus.NOT_AVAILABLE:
            # A new buffer, as DeepSpeed's all-gather allocates one.
            param.data = param.ds_tensor.clone().view(param.ds_shape)
            param.ds_status = ZeroParamStatus.AVAILABLE
            param.ds_stats.gathered(param)


def _partition(owner: nn.Parameter, param_list: list[nn.Parameter] | None = None, hierarchy: int = 0,
               has_been_updated: bool = False, free_data: bool = True) -> None:
    for param in param_list if param_list is not None else [owner]:
        if param.ds_status is ZeroParamStatus.INFLIGHT:
            raise AssertionError(f"cannot partition parameter {param.ds_id} in flight")
        if param.ds_status is not ZeroParamStatus.AVAILABLE:
            continue
        if param.ds_active_sub_modules:
            raise RuntimeError(f"cannot free parameter {param.ds_id} still active in {param.ds_active_sub_modules}")
        if has_been_updated:
            param.ds_tensor.copy_(param.data.reshape(-1))
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def partition(model: nn.Module, *, persist: Iterable[str] = ()) -> Stats:
    """Partition every parameter of ``model`` as ``deepspeed.zero.Init`` does (``persist``: names kept whole, as
    ``stage3_param_persistence_threshold`` keeps small ones)."""
    keep = set(persist)
    names: dict[int, str] = {}
    stats = Stats(names)
    for ds_id, (name, param) in enumerate(model.named_parameters()):
        names[ds_id] = name
        param.ds_id = ds_id
        param.ds_shape = param.shape
        param.ds_numel = param.numel()
        param.ds_tensor = param.data.detach().clone().reshape(-1)
        param.ds_status = ZeroParamStatus.AVAILABLE
        param.ds_persist = name in keep
        param.ds_active_sub_modules = set()
        param.ds_stats = stats
        param.all_gather = functools.partial(_all_gather, param)
        param.partition = functools.partial(_partition, param)
        if not param.ds_persist:
            param.partition()
    return stats


def full(param: nn.Parameter) -> torch.Tensor:
    """The whole value of a partitioned parameter, without gathering it."""
    return param.ds_tensor.view(param.ds_shape)


class GatheredParameters:
    """``deepspeed.zero.GatheredParameters(params, modifier_rank=None)``: whole within the block, partitioned after."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = sorted({p for p in params if hasattr(p, "ds_id")}, key=lambda p: p.ds_id)

    def __enter__(self) -> None:
        if self.params:
            self.params[0].all_gather(param_list=self.params)

    def __exit__(self, *exc: object) -> None:
        if self.params:
            self.params[0].partition(param_list=self.params)


def _direct(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if hasattr(p, "ds_id")]


def _instrumented(func: Any) -> Any:
    """DeepSpeed's NVTX decorator: a wrapper without functools.wraps, the function only in its closure."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    wrapped_fn.__module__ = "deepspeed.utils.nvtx"
    return wrapped_fn


def _each_tensor(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) is tuple:
        return tuple(_each_tensor(v, fn) for v in value)
    return value


class Engine:
    """The ZeRO-3 hooks of ``deepspeed.initialize`` on every module of ``model``, and gradient reduction.

    Gradients end in ``param.ds_grad`` (the whole gradient: one rank); :meth:`step` applies SGD to the partitions.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handles: list[Any] = []
        for param in model.parameters():
            if param.requires_grad:
                param.ds_grad = None
                self.handles.append(param.register_post_accumulate_grad_hook(self._reduce))
        for module in model.modules():
            self._register_deepspeed_module(module)

    @staticmethod
    def _reduce(param: nn.Parameter) -> None:
        # What DeepSpeed's reduce hook does with the gradient autograd accumulated into the (gathered) parameter.
        grad = param.grad.detach().clone()
        param.ds_grad = grad if param.ds_grad is None else param.ds_grad + grad
        param.grad = None

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        def fetch(active: str) -> None:
            params = _direct(module)
            for param in params:
                param.ds_active_sub_modules.add(f"{id(module)}:{active}")
            if params:
                params[0].all_gather(param_list=params)

        def release(active: str) -> None:
            params = _direct(module)
            for param in params:
                param.ds_active_sub_modules.discard(f"{id(module)}:{active}")
            done = [p for p in params if not p.ds_active_sub_modules and not p.ds_persist]
            if done:
                done[0].partition(param_list=done)

        class PreBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, output: torch.Tensor) -> torch.Tensor:
                return output.detach()

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                fetch("backward")
                return grad

        class PostBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
                module.ds_grads_remaining += 1
                return value.detach()

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                module.ds_grads_remaining -= 1
                if module.ds_grads_remaining == 0:
                    release("backward")
                return grad

        def _pre_forward_module_hook(module: nn.Module, *args: Any) -> None:
            fetch("forward")

        def _post_forward_module_hook(module: nn.Module, args: Any, output: Any) -> None:
            release("forward")

        def _pre_backward_module_hook(module: nn.Module, args: Any, output: Any) -> Any:
            return _each_tensor(output, lambda t: PreBackward.apply(t) if t.requires_grad else t)

        def _post_backward_module_hook(module: nn.Module, args: Any) -> Any:
            module.ds_grads_remaining = 0
            return _each_tensor(args, lambda t: PostBackward.apply(t) if t.requires_grad else t)

        for hook in (_pre_forward_module_hook, _post_forward_module_hook, _pre_backward_module_hook,
                     _post_backward_module_hook):
            hook.__module__ = _DEEPSPEED_MODULE
        self.handles += [
            module.register_forward_pre_hook(_pre_forward_module_hook),
            module.register_forward_hook(_instrumented(_post_forward_module_hook)),
            module.register_forward_hook(_pre_backward_module_hook),
            module.register_forward_pre_hook(_post_backward_module_hook),
        ]

    def release_all(self) -> None:
        """What the engine does at the end of a step: every parameter partitioned (its step's leftovers released)."""
        for param in self.model.parameters():
            param.ds_active_sub_modules.clear()
            if not param.ds_persist:
                param.partition()

    def step(self, lr: float) -> None:
        """SGD on the partitions with the reduced gradients; gathered persistent parameters follow."""
        self.release_all()
        with torch.no_grad():
            for param in self.model.parameters():
                if param.ds_grad is not None:
                    param.ds_tensor.sub_(lr * param.ds_grad.reshape(-1))
                    if param.ds_status is ZeroParamStatus.AVAILABLE:
                        param.data.copy_(full(param))
                    param.ds_grad = None
