"""The entry point: registered, cheap to import, and its hooks return detection and declarations."""

from __future__ import annotations

import subprocess
import sys

from kernels_core import KernelsPluginManager
from kernels_rocm import _plugin
from kernels_rocm import rocm_kernel_specs
from rocm_testing import MI300X


def test_hooks_return_detection_and_declarations(simulate):
    assert tuple(_plugin.kernels_core_kernels()) == rocm_kernel_specs()
    simulate("rocm", [MI300X])
    (info,) = _plugin.kernels_core_detect_devices()
    assert info.backend == "rocm" and info.devices[0].arch == "gfx942"


def test_entry_module_imports_no_torch_triton_or_liger():
    code = ("import sys, kernels_rocm._plugin as p; p.kernels_core_kernels(); "
            "print(sorted(m for m in ('torch', 'triton', 'liger_kernel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_entry_point_is_registered_and_loads_cleanly():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="kernels_core.plugins")}
    assert eps.get("rocm") == "kernels_rocm._plugin"
    pm = KernelsPluginManager(load_entrypoints=True, strict=True, allow=["rocm", "portable"], block=())
    info = pm.info("rocm")
    assert (info.status, info.distribution) == ("loaded", "kernels-rocm")
    assert {p.spec.id for p in pm.kernels() if p.plugin.name == "rocm"} == {s.id for s in rocm_kernel_specs()}
