"""Plugins with the mistakes a third-party author makes in declarations and kernels (issue table of
``test_check.py`` and ``test_manager.py``): each is a small, otherwise working plugin named ``acme``."""

from __future__ import annotations

import torch
from kernels_core import KernelSpec
from kernels_core import LayerKind
from kernels_core import Match
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import ConformanceCase
from kernels_core.testing import reference


_M = "mistaken_plugins"


def _rms(kernel_id, impl, *, priority=100, variants=("standard", "offset"), **extra):
    return KernelSpec(id=kernel_id, kind="rms_norm", variants=variants, backend="any", impl=f"{_M}:{impl}",
                      priority=priority, supports=Supports.BACKWARD, **extra)


def rms_norm(x, weight, *, eps, offset, casting):
    return reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting)


def rms_norm_no_eps(x, weight, *, eps, offset, casting):
    """Forgets ``eps``: right wherever rows have magnitude ~1, NaN on an all-zero row."""
    return reference.rms_norm(x, weight, eps=0.0, offset=offset, casting=casting)


def rms_norm_scaled(x, weight, *, eps, offset, casting):
    """1% too large."""
    return reference.rms_norm(x, weight, eps=eps, offset=offset, casting=casting) * 1.01


def rms_norm_float32_out(x, weight, *, eps, offset, casting):
    """Always returns float32, whatever the input dtype."""
    return reference.rms_norm(x.float(), weight.float(), eps=eps, offset=offset, casting=casting)


class Ok:
    """A correct kernel: its check passes."""

    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.ok", "rms_norm")]


class NoEps:
    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.no_eps", "rms_norm_no_eps")]


class Scaled:
    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.scaled", "rms_norm_scaled")]


class Float32Out:
    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.f32", "rms_norm_float32_out")]


class MisspeltApi:
    """``KERNELS_CORE_PLUGIN_APl`` (a lowercase L): the API version it meant to state is never read."""

    KERNELS_CORE_PLUGIN_APl = "2.0"

    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.ok", "rms_norm")]


class MisspeltField:
    """``prority=10`` in one of two specs."""

    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.ok", "rms_norm"),
                KernelSpec(id="acme.rms_norm.typo", kind="rms_norm", variants=("standard",), backend="any",
                           impl=f"{_M}:rms_norm", prority=10)]


class MisspeltVariant:
    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.ofset", "rms_norm", variants=("standard", "ofset"))]


class IdThief:
    """Declares another plugin's kernel id, with a higher priority."""

    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.ok", "rms_norm", priority=500)]


class MissingImpl:
    @hookimpl
    def kernels_core_kernels(self):
        return [_rms("acme.rms_norm.missing", "no_such_function")]


# -- a layer kind of its own, whose matcher reads module.fc1 before checking that it exists ---------------------------

class FcMlp(torch.nn.Module):
    def __init__(self, width=8, inner=12):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, inner)
        self.fc2 = torch.nn.Linear(inner, width)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def match_fc_mlp(module, name, ctx):
    if module.fc1.in_features <= 0:  # AttributeError on every module without fc1
        return None
    return Match("fc_mlp", "gelu")


def match_fc_mlp_careful(module, name, ctx):
    if not isinstance(getattr(module, "fc1", None), torch.nn.Linear):
        return None
    return match_fc_mlp(module, name, ctx)


def adapt_fc_mlp(module, match, impl, options):
    return lambda x: impl(x, module.fc1.weight, module.fc1.bias, module.fc2.weight, module.fc2.bias)


def fc_mlp(x, w1, b1, w2, b2):
    return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2, b2)


def fc_mlp_cases():
    return [ConformanceCase("gelu", "FcMlp(8)",
                            build=lambda device, dtype: (FcMlp().to(device=device, dtype=dtype), ""),
                            inputs=lambda target, gen: ((torch.randn(3, 8, generator=gen).to(target.fc1.weight),),
                                                        {}))]


class _FcMlpPlugin:
    matcher = "match_fc_mlp"

    @hookimpl
    def kernels_core_layer_kinds(self):
        return [LayerKind(name="fc_mlp", description="fc1 -> GELU -> fc2", variants=("gelu",),
                          matcher=f"{_M}:{self.matcher}", adapter=f"{_M}:adapt_fc_mlp",
                          conformance=f"{_M}:fc_mlp_cases")]

    @hookimpl
    def kernels_core_kernels(self):
        return [KernelSpec(id="acme.fc_mlp.fused", kind="fc_mlp", variants=("gelu",), backend="any",
                           impl=f"{_M}:fc_mlp", priority=10, dtypes=("float32",))]


class CarelessMatcher(_FcMlpPlugin):
    matcher = "match_fc_mlp"


class CarefulMatcher(_FcMlpPlugin):
    matcher = "match_fc_mlp_careful"
