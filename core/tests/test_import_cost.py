"""``import kernels_core`` and listing stay cheap: no torch, transformers, triton, liger or torch_npu."""

from __future__ import annotations

import json
import subprocess
import sys


HEAVY = ("torch", "transformers", "triton", "liger_kernel", "torch_npu")


def _run(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_import_does_not_load_heavy_modules():
    loaded = _run("import kernels_core")
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_discovery_and_listing_import_no_kernel_module():
    loaded = _run("import kernels_core\nkernels_core.list_plugins(); kernels_core.list_kernels()")
    impl_modules = {"kernels_core._portable._cross_entropy", "kernels_core._portable._rms_norm",
                    "kernels_core._portable._silu_mul"}
    assert not loaded & (set(HEAVY) - {"torch"}), sorted(loaded & set(HEAVY))
    assert not loaded & impl_modules, sorted(loaded & impl_modules)
    assert not any(name.startswith(("triton", "liger_kernel", "torch_npu")) for name in loaded)
