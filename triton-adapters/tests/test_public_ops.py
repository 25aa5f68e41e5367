"""The public operations module, ``kernels_triton.ops``: what other packages and kernel declarations use.

Each public name is the private module's object itself (no wrapper between kernelize and the kernel), loaded on
first use, documented with an example that runs; every declaration this package builds names it by its public path;
and resolving an adapter imports what importing its private module did, nothing more.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kernels_triton import LIGER_ADAPTERS
from kernels_triton import NATIVE_ADAPTERS
from kernels_triton import TRITON_ADAPTERS
from kernels_triton import ops


def test_every_public_name_is_listed_and_nothing_else():
    assert sorted(ops.__all__) == sorted(ops._SOURCES)
    assert set(ops.__all__) <= set(dir(ops))


@pytest.mark.parametrize("name", ops.__all__)
def test_each_name_is_the_private_object_itself(name):
    pytest.importorskip("triton", reason="kernels-triton's own kernels need Triton")
    module_name, attribute = ops._SOURCES[name]
    expected = getattr(importlib.import_module(f"kernels_triton.{module_name}"), attribute)
    assert getattr(ops, name) is expected
    assert ops.__dict__[name] is expected, "the loaded name is kept: later lookups are plain attribute reads"


@pytest.mark.parametrize("name", ops.__all__)
def test_each_name_is_documented_with_an_example_that_runs_here(name):
    pytest.importorskip("triton", reason="kernels-triton's own kernels need Triton")
    value = getattr(ops, name)
    if not (inspect.isfunction(inspect.unwrap(value)) or inspect.isclass(value)):
        # The Triton kernel object keeps no docstring of its own (Triton's interpreter drops it): the module
        # documents how it is launched.
        assert f"``{name}``" in ops.__doc__
        return
    examples = [example for test in doctest.DocTestFinder(recurse=False).find(value, name)
                for example in test.examples]
    assert examples, f"kernels_triton.ops.{name} has no docstring example"
    if all(example.options.get(doctest.SKIP) for example in examples):
        # Launch shapes that ask the GPU for its SM count: the example says it needs one.
        assert "on a GPU" in value.__doc__, f"kernels_triton.ops.{name}'s examples are all skipped without saying why"


def test_an_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_op'"):
        ops.no_such_op  # noqa: B018
    assert not hasattr(ops, "_rms_norm"), "the private modules are not reachable through ops"


@pytest.mark.parametrize("entry", [*TRITON_ADAPTERS.values(), *LIGER_ADAPTERS.values(), *NATIVE_ADAPTERS.values()],
                         ids=lambda entry: entry.impl)
def test_declarations_name_public_paths(entry):
    module, _, attribute = entry.impl.partition(":")
    assert module == "kernels_triton.ops" and attribute in ops.__all__, entry.impl


def _modules_after(script: str) -> list[str]:
    # A fresh process (this one has imported everything), with the warm-up thread off: it would import the
    # experts' kernel modules in the background.
    code = (f"import json, pkgutil, sys\n{script}\n"
            "print(json.dumps(sorted(m for m in ('torch', 'triton', 'liger_kernel') if m in sys.modules)))")
    env = {**os.environ, "KERNELS_TRITON_WARMUP": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_ops_imports_no_torch_triton_or_liger():
    assert _modules_after("from kernels_triton import ops") == []


def test_adapters_without_triton_kernels_load_no_triton():
    # As their private modules always did: the native adapters, Liger's LayerNorm and loss (Liger only on a GPU
    # call) and the grouped-product experts (Triton only on a GPU call).
    names = ["native_rms_norm", "native_residual_rms_norm", "native_silu_mul", "native_rotary_embedding",
             "native_layer_norm", "liger_layer_norm", "liger_fused_linear_cross_entropy", "moe_experts_silu",
             "liger_moe_experts_silu"]
    script = "\n".join(f"pkgutil.resolve_name('kernels_triton.ops:{name}')" for name in names)
    assert _modules_after(script) == ["torch"]


# The names kernels-triton 0.2 publishes. kernels-cuda and kernels-rocm accept any 0.2.x: removing or renaming one
# of these needs a new minor version and new ranges in their pyproject.toml files.
PUBLISHED_IN_0_2 = {
    "rms_norm", "eager_rms_norm", "residual_rms_norm", "eager_residual_rms_norm", "silu_mul", "gelu_tanh_mul",
    "rotary_embedding", "moe_experts_silu", "moe_experts_gelu_tanh", "liger_rms_norm", "liger_silu_mul",
    "liger_gelu_tanh_mul", "liger_rotary_embedding", "liger_layer_norm", "liger_moe_experts_silu",
    "liger_fused_linear_cross_entropy", "native_rms_norm", "native_residual_rms_norm", "native_silu_mul",
    "native_gelu_tanh_mul", "native_rotary_embedding", "native_layer_norm", "apply_rms_norm", "rms_norm_forward",
    "rms_norm_backward", "add_rms_norm_backward", "sum_partial_rows", "norm_tiling", "norm_backward_tiling",
    "rms_norm_forward_kernel", "cpp_autograd_extension", "cpp_autograd_status", "cpp_autograd_failure",
    "cpp_autograd_norm_call", "python_autograd_norms",
}


def test_the_published_names_stay_within_the_minor_release():
    missing = PUBLISHED_IN_0_2 - set(ops.__all__)
    assert not missing, f"kernels_triton.ops lost {sorted(missing)}: that is a new minor version of kernels-triton"
    repo = Path(__file__).resolve().parents[2]
    if not (repo / "plugins-cuda").is_dir():
        pytest.skip("the plugins' version ranges are read from the repository's checkout")
    version = re.search(r'^version = "(\d+)\.(\d+)\.', (repo / "triton-adapters/pyproject.toml").read_text(), re.M)
    assert version is not None and version.groups() == ("0", "2"), "update PUBLISHED_IN_0_2 with the version"
    for plugin in ("plugins-cuda", "plugins-rocm"):
        assert '"kernels-triton>=0.2,<0.3"' in (repo / plugin / "pyproject.toml").read_text(), plugin
