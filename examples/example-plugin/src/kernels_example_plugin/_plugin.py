"""Entry point ``example``: declarations only; importing this module imports neither torch nor the kernel."""

from __future__ import annotations

from collections.abc import Iterable

from kernels_core.plugin import KernelSpec
from kernels_core.plugin import LayerKind
from kernels_core.plugin import Supports
from kernels_core.plugin import hookimpl


__all__ = ["KERNELS_CORE_PLUGIN_API", "kernels_core_kernels", "kernels_core_layer_kinds"]

# The kernels-core plugin API this plugin is written for (kernels_core.plugin.PLUGIN_API_VERSION).
KERNELS_CORE_PLUGIN_API = "1.0"

_PKG = "kernels_example_plugin"


@hookimpl
def kernels_core_layer_kinds() -> Iterable[LayerKind]:
    return [
        LayerKind(
            name="plain_mlp",
            description="fc2(gelu(fc1(x))) MLP without a gate (Starcoder2, Phi, GPT-NeoX)",
            variants=("gelu_tanh", "gelu"),
            matcher=f"{_PKG}._kind:match_plain_mlp",
            adapter=f"{_PKG}._kind:adapt_plain_mlp",
            # What `kernels-core check` and kernels_core.testing.assert_conforms compare every kernel of the kind with.
            conformance=f"{_PKG}._conformance:cases",
        )
    ]


@hookimpl
def kernels_core_kernels() -> Iterable[KernelSpec]:
    return [
        KernelSpec(
            id="example.plain_mlp.recompute",
            kind="plain_mlp",
            variants=("gelu_tanh", "gelu"),
            backend="any",
            impl=f"{_PKG}._ops:gelu_recompute",
            priority=5,
            supports=Supports.BACKWARD | Supports.TORCH_COMPILE,
            description="GELU recomputed in backward: saves one activation-sized tensor per layer",
        )
    ]
