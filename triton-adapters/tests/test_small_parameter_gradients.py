"""bfloat16 gradients of small parameters (norm weights, xIELU's learnable scalars) through this package's kernels.

Each family's tiny model is kernelized with this package's own Triton kernels (RMSNorm, residual add + RMSNorm, RoPE,
SiLU-gated product) and Liger's fused linear cross-entropy through the adapter's custom op, bound by a test plugin:
compiled on a GPU, in Triton's interpreter on CPU tensors. The interpreter must round to bfloat16 as a GPU does
(conftest); with its own truncation these gradients came out about twice as far from float32 as eager's.

The bound is ``core/tests/kinds/test_families.py``'s for the core's kernels: each small parameter's gradient error
against the float32 model (same bfloat16-rounded weights, two batches together, the loss's upstream gradient 1/3 as
with gradient accumulation) at most twice eager's plus 2**-8 relative (bfloat16's largest rounding error).
"""

from __future__ import annotations

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.plugin import KernelSpec
from kernels_core.plugin import Supports
from kernels_core.plugin import hookimpl
from kernels_core.testing import FAMILIES
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


pytest.importorskip("triton", reason="this package's own kernels need Triton (installed with liger-kernel)")
pytest.importorskip("liger_kernel", reason="the loss is Liger's kernel (liger-kernel is a test dependency)")
pytest.importorskip("transformers", reason="the models are transformers' (a test dependency)")

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
# The interpreter runs each kernel program in Python: on CPU two families (one gated MLP, Apertus's xIELU) at a
# smaller batch; a GPU runs every family of the core's list.
FAMILIES_HERE = [*sorted(FAMILIES), "apertus"] if ON_GPU else ["llama", "apertus"]
TOKENS = (4, 63) if ON_GPU else (2, 31)
ACCUMULATION = 1 / 3


def rms_norm(x, weight, *, eps, offset, casting):
    from kernels_triton import _rms_norm

    return _rms_norm.apply_rms_norm(x, weight, eps=eps, offset=offset, gemma=casting == "gemma")


def residual_rms_norm(x, residual, weight, *, eps, offset, casting):
    from kernels_triton import _residual_rms_norm

    return _residual_rms_norm.apply_residual_rms_norm(x, residual, weight, eps=eps, offset=offset,
                                                      gemma=casting == "gemma")


def rotary(q, k, cos, sin, unsqueeze_dim=1):
    from kernels_triton import _rotary

    return _rotary.rotary(q, k, cos, sin)


def silu_mul(gate, up):
    from kernels_triton import _gated

    return _gated.gated_activation(gate, up, gelu=False)


def causal_lm_loss(hidden, weight, labels, *, bias, ignore_index, num_items_in_batch, softcap):
    from kernels_triton import _loss

    return _loss._liger_loss(hidden, weight, labels, bias=bias, ignore_index=ignore_index,
                             num_items_in_batch=num_items_in_batch, softcap=softcap)


class _KernelsHere:
    """The kernels above for any backend (the adapters route CPU tensors to native code; these do not)."""

    @staticmethod
    @hookimpl
    def kernels_core_kernels():
        spec = {"backend": "any", "priority": 60, "supports": Supports.BACKWARD,
                "dtypes": ("float16", "bfloat16", "float32")}
        return (
            KernelSpec(id="test.rms_norm", kind="rms_norm", variants=("standard", "offset"),
                       impl=f"{__name__}:rms_norm", **spec),
            KernelSpec(id="test.residual_rms_norm", kind="residual_rms_norm", variants=("standard", "offset"),
                       impl=f"{__name__}:residual_rms_norm", **spec),
            KernelSpec(id="test.rotary", kind="rotary_embedding", variants=("full",), impl=f"{__name__}:rotary",
                       **spec),
            KernelSpec(id="test.silu_mul", kind="silu_gated_mlp", variants=("split",), impl=f"{__name__}:silu_mul",
                       **spec),
            KernelSpec(id="test.loss", kind="causal_lm_loss", variants=("standard",),
                       impl=f"{__name__}:causal_lm_loss", **spec),
        )


@pytest.fixture(autouse=True)
def _sm_count_without_a_device(monkeypatch):
    if not ON_GPU:
        from kernels_triton import _norm_kernels

        monkeypatch.setattr(_norm_kernels, "sm_count", lambda index: 4)  # no device to ask; any count is correct


@pytest.mark.parametrize("family", FAMILIES_HERE)
def test_small_parameter_gradients_are_as_close_to_float32_as_eager(family):
    try:
        reference = tiny_causal_lm(family)
    except Exception as exc:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"{family} cannot be built from a tiny config with this transformers: {exc}")
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in reference.state_dict().items()}
    models = {}
    for which, dtype in (("fp32", torch.float32), ("eager", torch.bfloat16), ("kernelized", torch.bfloat16)):
        model = reference if which == "fp32" else tiny_causal_lm(family, dtype=dtype)
        model.load_state_dict(state)  # the float32 model holds the bfloat16 values: only the arithmetic differs
        models[which] = model.to(DEV).train()
    kernels_core.kernelize(models["kernelized"], mode=Mode.TRAINING,
                           plugin_manager=fresh_plugin_manager((_KernelsHere, "kernels_here")))
    entries = kernels_core.get_report(models["kernelized"]).entries
    chosen = {e.kernel for e in entries if e.kernel}
    # test.loss declares the standard loss only: a soft-capped one (Gemma 2) gets the portable kernel.
    standard_loss = any(e.kind == "causal_lm_loss" and e.variant == "standard" for e in entries)
    assert {"test.rms_norm", *(["test.loss"] if standard_loss else [])} <= chosen, chosen
    grads = {which: {} for which in models}
    for batch in range(2):
        ids = torch.randint(3, 100, TOKENS, generator=torch.Generator().manual_seed(10 + batch)).to(DEV)
        for which, model in models.items():
            model.zero_grad(set_to_none=True)
            (model(input_ids=ids, labels=ids).loss * ACCUMULATION).backward()
            for name, p in model.named_parameters():
                if p.dim() <= 1 and p.grad is not None:
                    grads[which].setdefault(name, []).append(p.grad.detach().double().flatten().cpu())
    assert grads["fp32"], f"{family}: no small parameters"
    for name, parts in grads["fp32"].items():
        truth = torch.cat(parts)
        eager_error, kernel_error = (float((torch.cat(grads[which][name]) - truth).norm() / truth.norm())
                                     for which in ("eager", "kernelized"))
        # Factor 2 and 2**-8, as for the core's kernels (see the module docstring).
        assert kernel_error <= 2 * eager_error + 2**-8, \
            f"{family} {name}: gradient error {kernel_error:.2e} vs float32, eager's {eager_error:.2e} (bfloat16)"
