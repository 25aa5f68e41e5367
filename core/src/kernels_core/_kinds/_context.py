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
import math
import sys
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .._binding import FOREIGN_FORWARD
from .._binding import instance_override
from .._binding import original_forward
from .._forward import decorator_chain_problem
from .._tolerance import probe_close as close
from .._tolerance import rel_error
from .._types import Match
from ._zero3 import full_shape
from ._zero3 import gathered


__all__ = [
    "MatchContext",
    "Probe",
    "ProbeRandomness",
    "probe_behaviour",
    "cache_keyword",
    "dtensor_placements",
    "fsdp_module_type",
    "large_activation",
    "math_key",
    "close",
    "module_device",
    "param_dtype",
    "plain_class_forward",
    "positional_arity",
    "rel_error",
    "reroute_blocker",
]


# What a bitsandbytes linear's first forward sets for good (see MatchContext.run_probe).
_BNB_STATE = ("compute_dtype", "compute_type_is_set")


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


def large_activation(dtype: torch.dtype) -> float:
    """A pre-activation magnitude for probing what random unit rows never reach: beyond the activation bounds models
    set (DeepSeek-V4's and Hunyuan-V4's SwiGLU limit clamps gate and up at 10, gpt-oss's at 7), while the product of
    two such values, summed over a projection, stays finite in ``dtype`` (1024; 16 in float16, whose largest value
    is 65504).

    Example:
        >>> large_activation(torch.bfloat16), large_activation(torch.float16)
        (1024.0, 16.0)
    """
    return 2.0 ** min(10, math.floor(math.log2(math.sqrt(torch.finfo(dtype).max))) - 3)


def positional_arity(fn: Callable[..., Any]) -> tuple[int, bool]:
    """(number of positional parameters after self, whether it takes *args) of a class forward."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional), any(p.kind is p.VAR_POSITIONAL for p in params)


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


@dataclass(frozen=True)
class Probe:
    """One probe run of what a kind's kernel replaces: the module's forward (``target="forward"`` kinds) or the global
    function its forward calls (``target="global"``), with the inputs it got and the output it gave (eval behaviour).

    kernelize runs the chosen kernel, through the kind's adapter, on the same inputs and compares the output's shape,
    dtype and device with ``output`` (``kernels_core._trial``).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any


# Random functions written in C (their parameters cannot be read from Python) that take ``generator=``; Python
# functions (``torch.nn.init``'s) are recognised by their parameters.
_RANDOM_BUILTINS = frozenset(
    [getattr(torch, name) for name in ("rand", "randn", "randint", "randperm", "rand_like", "randn_like",
                                       "randint_like", "bernoulli", "normal", "multinomial", "poisson", "binomial")
     if hasattr(torch, name)]
    + [getattr(torch.Tensor, name) for name in ("bernoulli", "bernoulli_", "uniform_", "normal_", "random_",
                                                "exponential_", "geometric_", "log_normal_", "cauchy_", "multinomial")
       if hasattr(torch.Tensor, name)]
)
# The parameters (and defaults) of the dropout functions and of SDPA, to read their arguments however passed.
_DROPOUT_PARAMETERS = {
    torch.nn.functional.dropout: (("input", "p", "training", "inplace"),
                                  {"p": 0.5, "training": True, "inplace": False}),
    torch.dropout: (("input", "p", "train"), {}),
}
_SDPA_PARAMETERS = (("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
                    {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False})


def _takes_generator(func: Callable[..., Any]) -> bool:
    if func in _RANDOM_BUILTINS:
        return True
    code = getattr(func, "__code__", None)
    return code is not None and "generator" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def _bind(names: tuple[str, ...], defaults: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
          ) -> dict[str, Any]:
    return {**defaults, **dict(zip(names, args, strict=False)), **kwargs}


class ProbeRandomness(TorchFunctionMode):
    """Within this block, random draws of this thread come from ``generator``, never from torch's default ones.

    Why a probe needs it: a probe runs a module's forward in training behaviour, where dropout draws random masks,
    and some probes compare two forwards (the module's own and a template of it) that must draw the same masks.
    torch's default generators are process-wide: seeding one for the probe and restoring it afterwards rewinds
    and reseeds every other thread drawing from it meanwhile (a model training with dropout while another model
    is kernelized). Dropout and SDPA take no generator, so disabling randomness per module would be the other way,
    but it would hide what the training run is there to show (a forward that draws its masks differently from
    the template). Torch function modes are per thread, so this reroutes only the probing thread's calls:

    - functions that take ``generator=`` (``torch.rand``, ``Tensor.bernoulli_``, ``torch.nn.init.*``, ...) get
      ``generator`` where the caller gave none and the call is on the generator's device;
    - ``F.dropout`` / ``torch.dropout`` in training and ``F.scaled_dot_product_attention`` with ``dropout_p > 0``
      run as the same math with masks drawn from ``generator`` (on its device, moved to the input's).

    Randomness drawn inside C++ code that calls no such function (a fused kernel seeding itself) still comes from
    the default generators; two probe runs then differ, and the probe leaves the module alone.

    Example:
        >>> import torch
        >>> x = torch.ones(1000)
        >>> with ProbeRandomness(torch.Generator().manual_seed(0)):
        ...     a = torch.nn.functional.dropout(x, 0.5)
        >>> with ProbeRandomness(torch.Generator().manual_seed(0)):
        ...     b = torch.nn.functional.dropout(x, 0.5)
        >>> torch.equal(a, b) and not torch.equal(a, x)
        True
    """

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        # The mode is off inside this method: the calls below run as they are.
        kwargs = kwargs or {}
        dropout = _DROPOUT_PARAMETERS.get(func)
        if dropout is not None:
            bound = _bind(*dropout, args, kwargs)
            p, training = bound["p"], bound.get("training", bound.get("train"))
            if training and isinstance(p, (int, float)) and 0 < p <= 1:
                return self._dropout(bound["input"], float(p), inplace=bool(bound.get("inplace", False)))
        elif func is torch.nn.functional.scaled_dot_product_attention:
            bound = _bind(*_SDPA_PARAMETERS, args, kwargs)
            if isinstance(bound["dropout_p"], (int, float)) and bound["dropout_p"] > 0:
                return self._attention(**bound)
        elif kwargs.get("generator") is None and _takes_generator(func) and self._on_device(args, kwargs):
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)

    def _on_device(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.get_default_device())
        device, own = torch.device(device), self.generator.device
        return device.type == own.type and (device.index is None or own.index is None or device.index == own.index)

    def _dropout(self, x: torch.Tensor, p: float, *, inplace: bool) -> torch.Tensor:
        own = self.generator.device
        keep = (torch.rand(x.shape, generator=self.generator, device=own) >= p).to(x.device)
        scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
        return x.mul_(keep).mul_(scale) if inplace else x * keep * scale

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
        # SDPA's math, with the attention weights' dropout drawn from the generator.
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        compute = torch.promote_types(query.dtype, torch.float32)
        scores = (query.to(compute) @ key.to(compute).transpose(-2, -1)) * scale
        if is_causal:
            allowed = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                      else scores + attn_mask.to(compute))
        weights = self._dropout(scores.softmax(dim=-1), float(dropout_p), inplace=False)
        return (weights @ value.to(compute)).to(query.dtype)


@contextlib.contextmanager
def probe_behaviour(module: nn.Module) -> Iterator[Callable[..., None]]:
    """Yields ``behave(training=...)``, which puts ``module`` and its sub-modules in eval or training behaviour for a
    probe run; on exit every sub-module's own ``training`` flag (and bitsandbytes' state below) is as it was.

    bitsandbytes' quantized linears compute the same in both modes, but an eval-mode forward on a CPU with
    AVX512-BF16 repacks a 4-bit weight for inference for good (later training forwards then skip autograd), and the
    first forward fixes the compute dtype to its input's. They stay in training mode, and get their compute dtype
    settings back, so that kernelize leaves them as the first real step would find them.

    Example:
        >>> from torch import nn
        >>> layer = nn.Sequential(nn.Dropout(0.1))
        >>> with probe_behaviour(layer) as behave:
        ...     behave(training=False)
        ...     layer[0].training
        False
        >>> layer[0].training
        True
    """
    flags = [(m, m.training) for m in module.modules()]
    quantized = {id(m): {k: m.__dict__[k] for k in _BNB_STATE if k in m.__dict__}
                 for m, _ in flags if type(m).__module__.startswith("bitsandbytes.")}

    def behave(*, training: bool) -> None:
        for m, _ in flags:
            m.training = training or id(m) in quantized

    try:
        yield behave
    finally:
        for m, was_training in flags:
            m.training = was_training
            m.__dict__.update(quantized.get(id(m), {}))


class MatchContext:
    """What a matcher receives as ``ctx``: one per kernelize call (and per ``kernels-core check`` case), shared by
    every matcher, so that probes are reproducible and identical layers are probed once.

    A matcher reads ``root``, ``config`` and ``mode`` and calls the methods below; ``memo`` and :meth:`probe_of`
    are the core's. A typical matcher (``x`` drawn from :meth:`generator`, ``reference`` its kind's math)::

        def match_plain_mlp(module, name, ctx):
            if not looks_like_one(module):
                return None

            def classify():
                eval_out, train_out = ctx.run_probe(module, ctx.original_forward(module), x)
                if not all(probe_close(out, reference(x), weight.dtype) for out in (eval_out, train_out)):
                    return Decline("plain_mlp", "probe output is not the reference math")
                ctx.note_probe(module, "plain_mlp", (x,), {}, eval_out)
                return Match("plain_mlp", "gelu", {...})

            return ctx.verdict("plain_mlp", module, classify)

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(4, 4)
        >>> ctx = MatchContext(layer)
        >>> cpu = torch.device("cpu")
        >>> x = ctx.randn(2, 4, device=cpu, dtype=torch.float32, gen=ctx.generator(cpu))
        >>> eval_out, train_out = ctx.run_probe(layer, ctx.original_forward(layer), x)
        >>> torch.equal(eval_out, layer(x))
        True

    Args:
        root: the model being kernelized (``ctx.root``).
        seed: the seed of every generator :meth:`generator` returns, so that classification is reproducible.
        mode: the :class:`~kernels_core.Mode` kernelize resolves for (``ctx.mode``), for kinds whose kernel runs in
            one mode only; None when unknown (``kernels-core check``).
        options: the configured ``[kinds.<name>] options`` per kind name (``ctx.options``), for matchers whose
            choice of modules an option widens (the ``linear`` kind's ``lm_head``).

    Attributes:
        root: the model.
        config: ``root.config`` (a transformers configuration), or None.
        mode: as above.
        options: as above.
    """

    def __init__(self, root: nn.Module, *, seed: int = 1234, mode: Any = None,
                 options: Mapping[str, Mapping[str, object]] | None = None) -> None:
        self.root = root
        self.mode = mode
        self.options: Mapping[str, Mapping[str, object]] = options or {}
        self.config = getattr(root, "config", None)
        self._seed = seed
        self._rotary_dims: set[int] | None = None
        self._parents: dict[int, nn.Module] | None = None
        self.memo: dict[tuple[object, ...], Any] = {}
        # (kind, id(module)) -> its probe; id(verdict) -> (verdict, probe), for modules whose verdict a memo gave.
        self._probes: dict[tuple[str, int], Probe] = {}
        self._probe_of_verdict: dict[int, tuple[object, Probe]] = {}

    def original_forward(self, module: nn.Module) -> Callable[..., Any]:
        """The callable computing the module's math before kernels-core bound anything to it, to probe.

        That is the instance's own forward (the class forward, bound), or what kernels-core's binding replaced; on a
        module kernelized before, never a kernel. Under accelerate's hooks it is ``_old_forward``: probing it
        directly skips only the device moves, which a probe built on the module's own device does not need.
        """
        return original_forward(module)

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
        """``[fn(*args) in eval behaviour, fn(*args) in training behaviour]``, in that order, under ``no_grad``.

        ``module`` and its sub-modules are put in eval, then training behaviour (dropout and the like show up), and
        get their own ``training`` flags back afterwards. ``fn`` is usually ``self.original_forward(module)``.
        A kernel replaces the forward in both modes, so both must compute the reference math. Each call draws its
        random numbers from a generator of its own, seeded alike (:class:`ProbeRandomness`): two forwards probed
        in the same behaviour see the same dropout masks, and torch's process-wide generators are never seeded,
        drawn from or rewound (another thread may be training with them).
        """
        device = module_device(module) or torch.device("cpu")
        outputs = []
        with torch.no_grad(), probe_behaviour(module) as behave:
            for training in (False, True):
                behave(training=training)
                with ProbeRandomness(self.generator(device)):
                    outputs.append(fn(*args))
        return outputs

    def note_probe(self, module: nn.Module, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   output: Any) -> None:
        """Record that what layer kind ``kind`` replaces in this module returned ``output`` for ``(args, kwargs)``.

        A matcher calls it after probing the original forward (or global function) on inputs its kernels take
        too, so that kernelize can check the chosen kernel's output against it without probing again.
        """
        self._probes[(kind, id(module))] = Probe(tuple(args), dict(kwargs), output)

    def probe_of(self, module: nn.Module, verdict: Any) -> Probe | None:
        """The probe behind ``verdict`` (a ``Match``) for this module: its own, or that of the module whose memoized
        verdict (the same object, for the same math) it shares; None where the kind records none. The core's."""
        probe = self._probes.get((verdict.kind, id(module)))
        if probe is not None:
            self._probe_of_verdict.setdefault(id(verdict), (verdict, probe))
            return probe
        shared = self._probe_of_verdict.get(id(verdict))
        return shared[1] if shared is not None and shared[0] is verdict else None

    def verdict(self, kind: str, module: nn.Module, compute: Callable[[], Any]) -> Any:
        """What ``compute()`` returns, computed once per piece of math in this context: layers sharing a math key
        get the same object back.

        The key is ``kind`` and everything the math can depend on besides the weight values: the classes, the
        scalar hyperparameters of the module and its children (epsilon, head_dim, activation settings...),
        parameter shapes, dtypes and devices, and any instance-level forward override. A 28-layer model is probed
        once per kind instead of 28 times. ``compute`` takes no argument and runs with the module's parameters
        gathered (:meth:`unsharded`), so it sees FSDP2- and ZeRO-3-managed weights whole; what it returns (a
        ``Match``, a ``Decline``, or a tuple of them) must hold nothing specific to this instance, such as its
        name. Probes noted with :meth:`note_probe` inside it are shared by the layers the verdict is shared with.
        """
        key = (kind, math_key(module))
        if key not in self.memo:
            with self.unsharded(module):
                self.memo[key] = compute()
            # Modules that share this verdict share its probe too (see probe_of).
            result = self.memo[key]
            for match in (result if isinstance(result, tuple) else (result,)):
                probe = self._probes.get((match.kind, id(module))) if isinstance(match, Match) else None
                if probe is not None:
                    self._probe_of_verdict.setdefault(id(match), (match, probe))
        return self.memo[key]

    def generator(self, device: torch.device) -> torch.Generator:
        """A new generator seeded with the context's seed, on ``device`` where torch has device generators (CPU and
        CUDA), else on the CPU (:meth:`randn` then moves what it draws). Each call starts the same sequence."""
        gen = torch.Generator(device=device) if device.type in ("cpu", "cuda") else torch.Generator()
        gen.manual_seed(self._seed)
        return gen

    def randn(self, *shape: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
        """Standard normal values of ``shape`` drawn in float32 from ``gen``, then cast to ``dtype`` on ``device``
        (the same values on every device and in every dtype, up to rounding)."""
        on = device if gen.device.type == device.type else torch.device("cpu")
        return torch.randn(*shape, generator=gen, device=on, dtype=torch.float32).to(device=device, dtype=dtype)

    def rotary_modules(self) -> list[nn.Module]:
        """The model's rotary embedding modules, in ``root.modules()`` order: those holding an ``inv_freq`` buffer, or
        one per attention type (``sliding_attention_inv_freq`` in Gemma 3)."""
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
        """Dimensions rotated by the model's rotary embedding modules (2 * len(inv_freq)); computed once."""
        if self._rotary_dims is None:
            dims: set[int] = set()
            for module in self.rotary_modules():
                for name, buffer in module._buffers.items():
                    if name.endswith("inv_freq") and isinstance(buffer, torch.Tensor) and buffer.dim() == 1:
                        dims.add(2 * buffer.numel())
            self._rotary_dims = dims
        return self._rotary_dims
