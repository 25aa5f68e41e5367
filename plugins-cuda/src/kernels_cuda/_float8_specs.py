"""Declarations of the FP8 linear kernels (torchao's float8 training), which nothing chooses automatically.

The ``linear`` kind is opt-in: these kernels run only where configuration names them, e.g.

.. code-block:: toml

    [kinds.linear]
    prefer = { any = ["cuda.linear.float8_rowwise"] }

or ``KernelizeCallback(fp8="rowwise")`` / LLaMA-Factory's ``kernel_config: {fp8: rowwise}``. Each declares what
it needs, so that a request this machine cannot honour raises ``KernelizeError`` with the reason:

- compute capability 8.9 or newer (Ada, Hopper and later: FP8 tensor cores; ``torch._scaled_mm``);
- torchao 0.17 or 0.18 (``pip install "kernels-cuda[fp8]"``), whose float8 training code they call;
- bfloat16 weights (the conformance bound is set for bf16 outputs; an FSDP2 ``MixedPrecisionPolicy`` over
  float32 weights is not served);
- ``Mode.TORCH_COMPILE`` (``compile_only``): eagerly, torchao's amax, scale and cast run as separate kernels and the
  step gets slower than in bf16; Inductor fuses them into the neighbouring ops.

Importing this module imports neither torch nor torchao.
"""

from __future__ import annotations

from kernels_core.plugin import CapabilityRange
from kernels_core.plugin import KernelSpec
from kernels_core.plugin import Supports


__all__ = ["FLOAT8_CAPABILITY", "FLOAT8_REQUIREMENT", "RECIPES", "float8_kernel_specs"]

# torch._scaled_mm's FP8 tensor-core products: sm_89 (Ada) and sm_90 (Hopper) onwards.
FLOAT8_CAPABILITY = CapabilityRange(min=(8, 9))
FLOAT8_REQUIREMENT = "torchao>=0.17,<0.19"
# torchao's recipe names: per-tensor scales (cuBLAS' FP8 GEMM), or per-row scales rounded to powers of two
# (CUTLASS' rowwise GEMM, every operand in e4m3).
RECIPES = ("tensorwise", "rowwise")
# Never compared with other kinds' priorities: an opt-in kind's kernels are used only as configuration names them.
PRIORITY = 100


def float8_kernel_specs(backend: str) -> tuple[KernelSpec, ...]:
    """One kernel per torchao recipe, ``<backend>.linear.float8_<recipe>``.

    Example:
        >>> [spec.id for spec in float8_kernel_specs("cuda")]
        ['cuda.linear.float8_tensorwise', 'cuda.linear.float8_rowwise']
    """
    return tuple(
        KernelSpec(
            id=f"{backend}.linear.float8_{recipe}",
            kind="linear",
            variants=("projection", "head"),
            backend=backend,
            impl=f"kernels_cuda._float8:float8_{recipe}_linear",
            priority=PRIORITY,
            supports=Supports.BACKWARD | Supports.TORCH_COMPILE,
            dtypes=("bfloat16",),
            capability=FLOAT8_CAPABILITY,
            requires=(FLOAT8_REQUIREMENT,),
            description=f"FP8 matrix products with {recipe} scales (torchao float8 training); opt-in, compile only",
            compile_only=True,
        )
        for recipe in RECIPES
    )
