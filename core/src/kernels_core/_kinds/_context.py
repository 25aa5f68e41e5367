"""What every matcher needs: the original forward of a module, probe inputs and tolerances.

Probes run the module's *original* forward (the class forward, or what kernels-core replaced) on a few random
rows under ``torch.no_grad()``, on the module's own device and dtype, with its real parameters. They never
change the module.

Two kinds of foreign wrapping are expected and composed with rather than refused:

- accelerate's hooks (``device_map``, offloading) move the class forward to ``module._old_forward`` and put a
  hook-calling partial in ``module.forward``. The math lives in ``_old_forward``, so that is what probes run and
  what kernels replace; the hooks keep running around the kernel.
- FSDP2 (``fully_shard``) keeps parameters as sharded DTensors between forwards. A probe unshards the FSDP units
  that own the probed module's parameters (one all-gather, identical on every rank because every rank classifies
  the same modules in the same order) and reshards them afterwards, so it sees the full tensors, in the dtype the
  forward really uses (FSDP's mixed-precision ``param_dtype`` included).
- DeepSpeed ZeRO-3 (``deepspeed.zero.Init`` or the engine) leaves every parameter's data empty between forwards.
  A probe gathers the probed module's partitioned parameters (in step on every rank, as above) and partitions
  them again afterwards; without that it would compare empty tensors, which agree with any math.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._forward import decorator_chain_problem
from ._zero3 import full_shape
from ._zero3 import gathered


__all__ = [
    "MatchContext",
    "accelerate_hooked",
    "FOREIGN_FORWARD",
    "cache_keyword",
    "dtensor_placements",
    "forward_slot",
    "fsdp_module_type",
    "instance_override",
    "math_key",
    "close",
    "module_device",
    "param_dtype",
    "plain_class_forward",
    "positional_arity",
    "rel_error",
    "reroute_blocker",
    "tolerance",
]

BINDING_ATTR = "_kernels_core_binding"

# Relative error (max |a-b| / max |b|) below which a probe counts as the same math. Generous enough for the
# module computing in a different order than the reference, tight enough that a (1 + w) offset, a different
# activation or a missing multiplier (errors of order 1) never passes.
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def tolerance(dtype: torch.dtype) -> float:
    return _TOLERANCE.get(dtype, 3e-2)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual - expected).abs().max() / scale)


def close(actual: object, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    # The dtype is part of the math: a kernel returns what the reference returns, and a module whose output dtype
    # differs (a float32 result from a bfloat16 input) would break the next layer if its kernel did not.
    return (
        isinstance(actual, torch.Tensor)
        and actual.shape == expected.shape
        and actual.dtype == expected.dtype
        and bool(torch.isfinite(actual).all())
        and rel_error(actual, expected) <= tolerance(dtype)
    )


def module_device(module: nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


def param_dtype(module: nn.Module) -> torch.dtype | None:
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def cache_keyword(fn: Callable[..., Any]) -> str:
    """The KV-cache parameter of a transformers function: ``cache`` from transformers 5.24 on, ``past_key_values``
    before (``inspect.signature`` reads through ``functools.wraps`` decorators)."""
    try:
        return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"


def plain_class_forward(module: nn.Module) -> Callable[..., Any]:
    """The class's forward with decorators peeled off (for reading its code, not for calling)."""
    return inspect.unwrap(type(module).forward)


def reroute_blocker(module: nn.Module, global_name: str, *, function: bool = True) -> str | None:
    """Why ``global_name`` in this module's forward cannot be rerouted per instance, or None if it can.

    ``function=False`` accepts a global that is not callable itself (a registry the forward looks functions up in).
    """
    problem = decorator_chain_problem(type(module).forward)
    if problem:
        return problem
    forward = plain_class_forward(module)
    if global_name not in forward.__code__.co_names:
        return f"the class forward does not call {global_name!r} directly"
    if instance_override(module) is not None:
        return f"{FOREIGN_FORWARD}; leaving it alone"
    if function and not callable(forward.__globals__.get(global_name)):
        return f"{global_name!r} is not a callable global of {forward.__module__}"
    return None


def positional_arity(fn: Callable[..., Any]) -> tuple[int, bool]:
    """(number of positional parameters after self, whether it takes *args) of a class forward."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional), any(p.kind is p.VAR_POSITIONAL for p in params)


def accelerate_hooked(module: nn.Module) -> bool:
    """Whether accelerate's ``add_hook_to_module`` wrapped this instance (the class forward is in ``_old_forward``)."""
    namespace = module.__dict__
    return "_hf_hook" in namespace and "_old_forward" in namespace


def forward_slot(module: nn.Module) -> str:
    """The instance attribute holding the module's own math: ``_old_forward`` under accelerate's hooks."""
    return "_old_forward" if accelerate_hooked(module) else "forward"


# Why a module whose forward other code replaced per instance is left alone (the report's reason starts so).
FOREIGN_FORWARD = "the instance forward was already replaced by other code"


def instance_override(module: nn.Module) -> object | None:
    """What replaced the class forward on this instance before kernels-core bound anything, or None.

    accelerate's hook partial is not an override (the math is what it calls), and neither is the class forward
    bound to the instance, which is what accelerate stores when it wraps a plain module.
    """
    slot = forward_slot(module)
    record = module.__dict__.get(BINDING_ATTR)
    value = record.previous.get(slot) if record is not None and slot in record.previous else module.__dict__.get(slot)
    if value is None or (record is not None and value is record.MISSING):
        return None
    if getattr(value, "__self__", None) is module and getattr(value, "__func__", None) is type(module).forward:
        return None
    return value


def dtensor_placements(tensor: object) -> str | None:
    """The placements of a DTensor (tensor parallel or sharded), or None for a plain tensor."""
    if "torch.distributed.tensor" not in sys.modules:  # nothing can be a DTensor before that is imported
        return None
    from torch.distributed.tensor import DTensor

    return str(tuple(tensor.placements)) if isinstance(tensor, DTensor) else None


def fsdp_module_type() -> type | None:
    """``torch.distributed.fsdp.FSDPModule``, or None where nothing can be FSDP2-managed (never imports it)."""
    if "torch.distributed.fsdp" not in sys.modules:  # fully_shard imports it; nothing is FSDP-managed otherwise
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    return FSDPModule


_SCALARS = (bool, int, float, str, type(None))


def _scalars(module: nn.Module) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(
        (name, value) for name, value in vars(module).items()
        if isinstance(value, _SCALARS) and not name.startswith("_") and name != "training"
    ))


def math_key(module: nn.Module) -> tuple[object, ...]:
    """Identity of a module's math up to weight values (see :meth:`MatchContext.verdict`)."""
    parts: list[object] = []
    for name, child in module.named_modules():
        # Our own binding counts as what it replaced (instance_override reads the binding record).
        override = instance_override(child)
        parts.append((name, type(child), _scalars(child), None if override is None else id(override)))
    for name, param in module.named_parameters():
        # A ZeRO-3 parameter's data is empty between forwards: its whole shape tells layers apart.
        parts.append((name, tuple(full_shape(param)), param.dtype, param.device))
    for name, buffer in module.named_buffers():
        parts.append((name, tuple(buffer.shape), buffer.dtype, buffer.device))
    return tuple(parts)


class MatchContext:
    """Per-kernelize-call state shared by matchers.

    Args:
        root: the model being kernelized.
        seed: seed for probe inputs, so classification is reproducible.
        mode: the mode kernelize resolves for (a ``kernels_core.Mode``), for kinds whose kernel runs in one
            mode only; None when unknown.
    """

    def __init__(self, root: nn.Module, *, seed: int = 1234, mode: Any = None) -> None:
        self.root = root
        self.mode = mode
        self.config = getattr(root, "config", None)
        self._seed = seed
        self._rotary_dims: set[int] | None = None
        self._parents: dict[int, nn.Module] | None = None
        self.memo: dict[tuple[object, ...], Any] = {}

    def original_forward(self, module: nn.Module) -> Callable[..., Any]:
        """The forward computing the module's math before kernels-core bound anything to it.

        Under accelerate's hooks that is ``_old_forward``: probing it directly skips only the device moves, which
        a probe built on the module's own device does not need.
        """
        slot = forward_slot(module)
        record = module.__dict__.get(BINDING_ATTR)
        if record is not None and slot in record.previous:
            previous = record.previous[slot]
            if previous is not record.MISSING:
                return previous
            return type(module).forward.__get__(module, type(module))
        return getattr(module, slot)

    def _fsdp_units(self, module: nn.Module) -> list[nn.Module]:
        """FSDP2 units owning parameters of ``module`` that are sharded right now (empty without FSDP2)."""
        fsdp_module = fsdp_module_type()
        if fsdp_module is None or not any(dtensor_placements(p) for p in module.parameters()):
            return []
        if self._parents is None:
            self._parents = {id(child): parent for parent in self.root.modules() for child in parent.children()}
        units: list[nn.Module] = []
        ancestor: nn.Module | None = module
        while ancestor is not None and not isinstance(ancestor, fsdp_module):
            ancestor = self._parents.get(id(ancestor))
        if ancestor is not None:
            units.append(ancestor)
        units.extend(m for m in module.modules() if isinstance(m, fsdp_module) and m is not ancestor)
        return units

    def fsdp_managed(self, module: nn.Module) -> bool:
        """Whether FSDP2 shards this module's parameters between forwards (and gathers them for each forward)."""
        return bool(self._fsdp_units(module))

    @contextlib.contextmanager
    def unsharded(self, module: nn.Module) -> Iterator[None]:
        """Within this block the module's FSDP2-sharded parameters are full, plain tensors, and its DeepSpeed ZeRO-3
        partitioned ones are gathered (a no-op otherwise)."""
        units = self._fsdp_units(module)
        done: list[nn.Module] = []
        try:
            for unit in units:
                unit.unshard()
                done.append(unit)
            with gathered(module):
                yield
        finally:
            for unit in reversed(done):
                unit.reshard()

    @contextlib.contextmanager
    def parameters_as(self, module: nn.Module, replacements: dict[str, torch.Tensor]) -> Iterator[None]:
        """Within this block ``module``'s named parameters are these tensors (to probe another dtype's rounding)."""
        saved = {name: module._parameters[name] for name in replacements}
        try:
            for name, tensor in replacements.items():
                module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
            yield
        finally:
            module._parameters.update(saved)

    def run_probe(self, module: nn.Module, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(*args)`` with the module in eval and in training behaviour (dropout and the like show up).

        A kernel replaces the forward in both modes, so both must compute the reference math.
        """
        flags = [(m, m.training) for m in module.modules()]
        outputs = []
        try:
            with torch.no_grad():
                for training in (False, True):
                    for m, _ in flags:
                        m.training = training
                    outputs.append(fn(*args))
        finally:
            for m, was_training in flags:
                m.training = was_training
        return outputs

    def verdict(self, kind: str, module: nn.Module, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per distinct piece of math: layers sharing a math key share the probe's verdict.

        The key holds everything the math can depend on besides the weight values: the classes, the scalar
        hyperparameters of the module and its children (epsilon, head_dim, activation settings...), parameter
        shapes, dtypes and devices, and any instance-level forward override. A 28-layer model is probed once
        per kind instead of 28 times.
        """
        key = (kind, math_key(module))
        if key not in self.memo:
            with self.unsharded(module):
                self.memo[key] = compute()
        return self.memo[key]

    def generator(self, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device) if device.type in ("cpu", "cuda") else torch.Generator()
        gen.manual_seed(self._seed)
        return gen

    def randn(self, *shape: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
        on = device if gen.device.type == device.type else torch.device("cpu")
        return torch.randn(*shape, generator=gen, device=on, dtype=torch.float32).to(device=device, dtype=dtype)

    def rotary_modules(self) -> list[nn.Module]:
        """The model's rotary embedding modules: those holding an ``inv_freq`` buffer, or one per attention type
        (``sliding_attention_inv_freq`` in Gemma 3)."""
        return [m for m in self.root.modules() if any(name.endswith("inv_freq") for name in m._buffers)]

    def position_embeddings(self, x: torch.Tensor, position_ids: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) from the model's own rotary embedding for activations like ``x``, in the dtype and layout its
        attention receives them, or None if no rotary module takes ``(x, position_ids)``."""
        for module in self.rotary_modules():
            try:
                with torch.no_grad():
                    out = module(x, position_ids)
            except Exception:  # noqa: BLE001 - another signature (per layer type, ...): the caller decides
                continue
            if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out):
                return out
        return None

    def rotary_dims(self) -> set[int]:
        """Dimensions rotated by the model's rotary embedding modules (2 * len(inv_freq))."""
        if self._rotary_dims is None:
            dims: set[int] = set()
            for module in self.rotary_modules():
                for name, buffer in module._buffers.items():
                    if name.endswith("inv_freq") and isinstance(buffer, torch.Tensor) and buffer.dim() == 1:
                        dims.add(2 * buffer.numel())
            self._rotary_dims = dims
        return self._rotary_dims
