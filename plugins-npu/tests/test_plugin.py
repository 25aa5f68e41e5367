"""kernels_npu._plugin and _specs: what kernels-npu declares to kernels-core."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path
from pkgutil import resolve_name

from kernels_core.plugin import KernelSpec
from kernels_core.plugin import Supports
from kernels_npu import _plugin


def test_entry_point_is_registered():
    (ep,) = [ep for ep in metadata.entry_points(group="kernels_core.plugins") if ep.name == "npu"]
    assert ep.value == "kernels_npu._plugin"
    assert ep.dist.metadata["Name"] == "kernels-npu"


def test_kernel_declarations_are_honest():
    specs = list(_plugin.kernels_core_kernels())
    assert all(isinstance(spec, KernelSpec) for spec in specs)
    assert {spec.id for spec in specs} == {
        "npu.rms_norm.fused", "npu.residual_rms_norm.rms_norm", "npu.silu_gated_mlp.swiglu",
        "npu.rotary_embedding.rotary_mul", "npu.attention.fusion", "npu.moe_experts.grouped_matmul",
    }
    for spec in specs:
        assert spec.backend == "npu" and spec.priority >= 100
        assert spec.requires == ()  # torch_npu is a runtime/detection matter: its distribution name varies
        # Every operator has a backward (npu_grouped_matmul through our autograd.Function, tested in test_gmm);
        # none is claimed torch.compile-safe without hardware to check it on.
        assert spec.supports == Supports.BACKWARD
        assert callable(resolve_name(spec.impl))
    variants = {spec.kind: spec.variants for spec in specs}
    assert variants["rotary_embedding"] == ("full", "partial")  # no interleaved: only 'half' mode is wired
    assert variants["moe_experts"] == ("silu",)  # npu_swiglu is SiLU-only


def test_attention_layer_kind_reroutes_a_global_per_instance():
    (kind,) = _plugin.kernels_core_layer_kinds()
    assert kind.name == "attention" and kind.target == "global"
    assert callable(resolve_name(kind.matcher)) and callable(resolve_name(kind.adapter))


def test_plugin_import_and_declarations_do_not_import_torch_npu_or_kernels():
    emulation = str(Path(__file__).parent / "emulation")
    code = (
        f"import sys; sys.path.insert(0, {emulation!r})\n"  # the emulation is importable: an eager import would show
        "import kernels_npu._plugin as p\n"
        "list(p.kernels_core_kernels()); list(p.kernels_core_layer_kinds())\n"
        "loaded = sorted(m for m in sys.modules if m in ('torch', 'torch_npu') or m.startswith('kernels_npu.'))\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['kernels_npu._detect', 'kernels_npu._plugin', 'kernels_npu._specs', " \
                          "'kernels_npu._torch_npu']"
