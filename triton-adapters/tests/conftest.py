from __future__ import annotations

import os

import pytest
import torch


# Without a GPU, this package's own Triton kernels run in Triton's interpreter on CPU tensors (tests named
# "interpreter"): same kernel code, numpy arithmetic. Triton reads the switch when a kernel is decorated, so it is
# set before any test imports the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_rounds_bfloat16_to_nearest() -> None:
    """Make Triton's interpreter round float32 to bfloat16 to nearest even, as GPUs (and torch) do.

    Triton's interpreter (3.x) converts float32 to bfloat16 by dropping the low mantissa bits: every bfloat16 value
    a kernel writes there is pulled toward zero, by about 0.3% of its size on average, and the errors no longer
    cancel in a sum. Through a model's backward that made this package's kernels look twice as far from float32 as
    eager in bfloat16 (a parameter gradient sums thousands of such values), while compiled for a GPU the same
    ``.to(tl.bfloat16)`` rounds to nearest even. Converting as the GPU does keeps the interpreter checking the
    kernels' arithmetic rather than the interpreter's conversion; ``test_interpreter.py`` checks that it does.
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    cast = getattr(builder, "cast_impl", None)
    if cast is None or getattr(cast, "_rounds_to_nearest", False):
        return  # patched already, or another Triton: test_interpreter.py says whether it rounds as a GPU

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202 - the interpreter's own signature
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = np.array(src.data, dtype=np.float32)  # a copy, of any rank (scalars included)
            rounded = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(rounded, dst_type.scalar)
        return cast(self, src, dst_type)

    cast_impl._rounds_to_nearest = True
    builder.cast_impl = cast_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_rounds_bfloat16_to_nearest()


@pytest.fixture(scope="session")
def triton_kernels():
    """The op modules' kernel-level entry points (Python autograd path), ready to run here: compiled for the GPU, or
    in Triton's interpreter."""
    pytest.importorskip("triton", reason="this package's own kernels need Triton (installed with liger-kernel)")
    from types import SimpleNamespace

    from kernels_triton import _gated
    from kernels_triton import _norm_kernels
    from kernels_triton import _residual_rms_norm
    from kernels_triton import _rms_norm
    from kernels_triton import _rotary

    if not torch.cuda.is_available():
        if not _norm_kernels._rms_norm_fwd_kernel.__class__.__name__.startswith("Interpreted"):
            pytest.fail("kernels_triton's kernels were imported before TRITON_INTERPRET was set; run these tests in "
                        "a process of their own")
        _norm_kernels.sm_count = lambda index: 4  # no device to ask; any program count is correct
    return SimpleNamespace(
        rms_norm=_rms_norm.apply_rms_norm, rms_norm_forward=_norm_kernels.rms_norm_forward,
        add_rms_norm_backward=_norm_kernels.add_rms_norm_backward,
        norm_backward_tiling=_norm_kernels.norm_backward_tiling,
        residual_rms_norm=_residual_rms_norm.apply_residual_rms_norm, rotary=_rotary.rotary,
        gated_activation=_gated.gated_activation, gate_up_activation=_gated.gate_up_activation)


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Floors for the relative error against a float64 truth, per dtype, for outputs that are exactly rounded once or
# twice: float32 keeps ~7 digits, float16 has a 2**-11 unit roundoff and bfloat16 2**-8; the floors are a few
# units of roundoff so that two correct implementations that round at different points both pass.
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    x, truth = x.double(), truth.double()
    return ((x - truth).norm() / truth.norm().clamp_min(1e-30)).item()


def assert_as_good_as_eager(ours: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype,
                            what: str) -> None:
    """Ours may be at most twice as far from the float64 truth as eager in the same dtype, plus a small floor."""
    assert ours.shape == eager.shape, f"{what}: shape {tuple(ours.shape)} != eager {tuple(eager.shape)}"
    assert ours.dtype == eager.dtype, f"{what}: dtype {ours.dtype} != eager {eager.dtype}"
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    e_ours, e_eager = rel_err(ours, truth), rel_err(eager, truth)
    assert e_ours <= 2 * e_eager + FLOOR[dtype], f"{what}: error {e_ours:.2e} vs eager {e_eager:.2e} ({dtype})"


def run_with_grads(fn, inputs, params, grad_out):
    """Forward, then backward with a fixed upstream gradient; returns outputs and the gradients of inputs+params."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (*inputs, *params)]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grad_out, strict=True)])
    return outs, [leaf.grad for leaf in leaves]


def compare_with_eager(fn_ours, fn_eager, inputs, params, dtype, what, *, floor=None):
    """Outputs and every gradient of ``fn_ours`` against ``fn_eager`` in ``dtype``, with eager in float64 as truth.

    ``floor`` overrides the per-dtype floor (for kernels whose matmuls use TF32, say).
    """
    device = inputs[0].device
    with torch.no_grad():
        probe = fn_eager(*[t.to(dtype) for t in (*inputs, *params)])
    probe = probe if isinstance(probe, tuple) else (probe,)
    grad_out = [torch.randn(p.shape, device=device, dtype=torch.float64) for p in probe]
    cast = [t.to(dtype) for t in inputs], [t.to(dtype) for t in params]
    ours, g_ours = run_with_grads(fn_ours, *cast, grad_out)
    eager, g_eager = run_with_grads(fn_eager, *cast, grad_out)
    truth, g_truth = run_with_grads(fn_eager, [t.double() for t in inputs], [t.double() for t in params], grad_out)
    saved = FLOOR[dtype]
    if floor is not None:
        FLOOR[dtype] = floor
    try:
        for i, (o, e, t) in enumerate(zip(ours, eager, truth, strict=True)):
            assert_as_good_as_eager(o, e, t, dtype, f"{what} output {i}")
        for i, (o, e, t) in enumerate(zip(g_ours, g_eager, g_truth, strict=True)):
            assert o is not None, f"{what}: no gradient for argument {i}"
            assert_as_good_as_eager(o, e, t, dtype, f"{what} grad {i}")
    finally:
        FLOOR[dtype] = saved


def eager_rotary(q, k, cos, sin):
    """transformers' own ``apply_rotary_pos_emb``, over the first ``cos.shape[-1]`` dims (the rest passes through)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = cos.shape[-1]
    if rotary == q.shape[-1]:
        return apply_rotary_pos_emb(q, k, cos, sin)
    q_e, k_e = apply_rotary_pos_emb(q[..., :rotary], k[..., :rotary], cos, sin)
    return torch.cat((q_e, q[..., rotary:]), -1), torch.cat((k_e, k[..., rotary:]), -1)


def assert_upstream_gradient_untouched(rms_norm, device):
    """An RMSNorm's backward must not write into the incoming gradient: Liger's ``in_place=True`` overwrote dY with
    dX (Liger #370), and a residual branch consuming the same dY then got a wrong gradient (Gemma2 diverged)."""
    x = torch.randn(64, 256, device=device, requires_grad=True)
    w = torch.ones(256, device=device, requires_grad=True)
    y = rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")
    dy = torch.randn_like(y)
    keep = dy.clone()
    y.backward(dy)
    assert torch.equal(dy, keep)


@pytest.fixture(scope="session", autouse=True)
def _cpp_autograd_ready():
    """On a GPU, wait for the C++ autograd extension's background build, so every norm test with autograd runs
    the path users get once it is built (test_cpp_extension.py compares it with the Python path)."""
    if torch.cuda.is_available():
        pytest.importorskip("triton", reason="the extension launches this package's Triton kernels")
        from kernels_triton import _cpp_extension

        _cpp_extension.extension(wait=True)
