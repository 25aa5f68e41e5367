"""Third-party plugins with the mistakes plugin authors make: a matcher or an adapter that raises, kernels whose output
has the wrong shape or dtype, a kernel that raises. Used by ``test_fallbacks.py``, ``test_trial.py`` and
``test_check.py``."""

from __future__ import annotations

import kernels_core
import pytest
import torch
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import LayerKind
from kernels_core import Match
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import ConformanceCase
from kernels_core.testing import reference


_M = "broken_plugins"


def assert_strict_refuses(model, *, match: str, **kernelize_kwargs) -> None:
    """``kernelize(model, strict=True, ...)`` raises ``KernelizeError`` matching ``match`` and leaves ``model``
    exactly as it was: every module's attributes the same, and no report."""
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with pytest.raises(KernelizeError, match=match):
        kernels_core.kernelize(model, strict=True, **kernelize_kwargs)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before
    assert kernels_core.get_report(model) is None
_ALL = Supports.BACKWARD | Supports.TORCH_COMPILE


# -- a plugin layer kind over nn.Linear, with conformance cases ------------------------------------------------------

def _matcher(kind, raising=False):
    def match(module, name, ctx):
        if not isinstance(module, torch.nn.Linear):
            return None
        if raising:
            raise RuntimeError(f"matcher confused by {type(module).__name__}")
        return Match(kind, "plain")
    return match


match_good = _matcher("good_linear")
match_raising = _matcher("sharp_linear", raising=True)
match_flat = _matcher("flat_linear")
match_down_proj = _matcher("wide_linear")


def match_down_proj_only(module, name, ctx):
    return match_down_proj(module, name, ctx) if name.endswith("mlp.down_proj") else None


def adapt_linear(module, match, impl, options):
    return lambda x: impl(x, module.weight, module.bias)


def adapt_raising(module, match, impl, options):
    # Breaks on kernels that do not take a bias (a wrong assumption in the adapter), not on the others.
    if not getattr(impl, "takes_bias", True):
        raise TypeError(f"adapter cannot build around {impl.__name__}: it takes no bias")
    return lambda x: impl(x, module.weight, module.bias)


def adapt_always_raising(module, match, impl, options):
    raise RuntimeError("adapter always fails")


def linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


def linear_no_bias(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


linear_no_bias.takes_bias = False


def linear_wide(x, weight, bias):
    """One output column too many."""
    out = torch.nn.functional.linear(x, weight, bias)
    return torch.cat((out, out[..., :1]), dim=-1)


def linear_raising(x, weight, bias):
    raise ValueError("linear kernel exploded")


def linear_cases():
    return [ConformanceCase("plain", "Linear(8, 8)",
                            build=lambda device, dtype: (torch.nn.Linear(8, 8).to(device=device, dtype=dtype), ""),
                            inputs=lambda target, gen: ((torch.randn(3, 8, generator=gen).to(target.weight),), {}))]


def _linear_kind(name, matcher, adapter=f"{_M}:adapt_linear"):
    return LayerKind(name=name, description="linear", variants=("plain",), matcher=f"{_M}:{matcher}",
                     adapter=adapter, conformance=f"{_M}:linear_cases")


def _linear_kernel(kernel_id, kind, impl, priority=0, supports=Supports.BACKWARD):
    return KernelSpec(id=kernel_id, kind=kind, variants=("plain",), backend="any", impl=f"{_M}:{impl}",
                      priority=priority, supports=supports, dtypes=("float32",))


class Good:
    """A working plugin kind: its kernels must keep binding whatever the broken plugins do."""

    @hookimpl
    def kernels_core_layer_kinds(self):
        return [_linear_kind("good_linear", "match_good")]

    @hookimpl
    def kernels_core_kernels(self):
        return [_linear_kernel("good.linear", "good_linear", "linear")]


class MatcherRaises:
    @hookimpl
    def kernels_core_layer_kinds(self):
        return [_linear_kind("sharp_linear", "match_raising")]

    @hookimpl
    def kernels_core_kernels(self):
        return [_linear_kernel("sharp.linear", "sharp_linear", "linear")]


class AdapterRaises:
    """Its adapter raises for one of its two kernels (the better-ranked one)."""

    @hookimpl
    def kernels_core_layer_kinds(self):
        return [_linear_kind("flat_linear", "match_flat", adapter=f"{_M}:adapt_raising")]

    @hookimpl
    def kernels_core_kernels(self):
        return [_linear_kernel("flat.linear.nobias", "flat_linear", "linear_no_bias", priority=10),
                _linear_kernel("flat.linear", "flat_linear", "linear", priority=5)]


class AdapterAlwaysRaises:
    @hookimpl
    def kernels_core_layer_kinds(self):
        return [_linear_kind("flat_linear", "match_flat", adapter=f"{_M}:adapt_always_raising")]

    @hookimpl
    def kernels_core_kernels(self):
        return [_linear_kernel("flat.linear.nobias", "flat_linear", "linear_no_bias", priority=10)]


class KernelRaises:
    """A linear kernel that raises, declared compile-safe: ``check`` must show its own exception when compiled."""

    @hookimpl
    def kernels_core_layer_kinds(self):
        return [_linear_kind("good_linear", "match_good")]

    @hookimpl
    def kernels_core_kernels(self):
        return [_linear_kernel("raising.linear", "good_linear", "linear_raising", supports=_ALL)]


class WideDownProj:
    """A kind without a probe over MLP down projections, whose kernel returns one column too many: nothing can check
    it at kernelize, and the model's own code raises later."""

    @hookimpl
    def kernels_core_layer_kinds(self):
        return [LayerKind(name="wide_linear", description="down_proj", variants=("plain",),
                          matcher=f"{_M}:match_down_proj_only", adapter=f"{_M}:adapt_linear")]

    @hookimpl
    def kernels_core_kernels(self):
        return [_linear_kernel("wide.linear", "wide_linear", "linear_wide")]


# -- kernels of core kinds (which probe at kernelize) with the wrong output ------------------------------------------

def rms_norm_wide(x, weight, *, eps, offset, casting):
    out = reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting)
    return torch.cat((out, out[..., :1]), dim=-1)


def rms_norm_double(x, weight, *, eps, offset, casting):
    return reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting).double()


def rms_norm_raising(x, weight, *, eps, offset, casting):
    raise ValueError("rms_norm kernel exploded")


def rotary_swapped(q, k, cos, sin, unsqueeze_dim=1):
    """Returns (k, q): shapes differ wherever q and k have different head counts."""
    q_out, k_out = reference.rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return k_out, q_out


def _rms(kernel_id, impl, priority=100):
    return KernelSpec(id=kernel_id, kind="rms_norm", variants=("standard", "offset"), backend="any",
                      impl=f"{_M}:{impl}", priority=priority, supports=_ALL)


class WrongRmsNorm:
    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("wrong.rms_norm.wide", "rms_norm_wide"), _rms("wrong.rms_norm.double", "rms_norm_double", 90),
                _rms("wrong.rms_norm.raising", "rms_norm_raising", 80)]


class WrongRotary:
    @hookimpl
    def kernels_core_kernels(self):
        return [KernelSpec(id="wrong.rotary.swapped", kind="rotary_embedding", variants=("full", "partial"),
                           backend="any", impl=f"{_M}:rotary_swapped", priority=100, supports=_ALL)]
