"""The C++ autograd extension for the norms (``kernels_triton._cpp_extension``, ``_autograd_ext.cpp``).

Anywhere: which compiled Triton kernels it accepts (their launcher ABI), when it switches itself off, and that its
source builds against the installed torch (where a C++ compiler and ninja exist). On a GPU: the C++ autograd
path gives bit-identical outputs and gradients to the Python autograd path it replaces (the same compiled kernels
and launch shapes), for every dtype, odd shapes, the Llama/Gemma/offset variants and the residual variant with
and without the sum's gradient; and it steps aside where it must (launch hooks, misaligned inputs).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import DTYPES
from conftest import requires_cuda


triton = pytest.importorskip("triton", reason="the extension launches this package's Triton kernels")

from kernels_triton import _cpp_extension  # noqa: E402 - after the skip


# The C++ extension's autograd nodes are named KernelsTritonRMSNormBackward and
# KernelsTritonResidualRMSNormBackward; the Python path's are _RMSNormBackward and _AddRMSNormBackward.
CPP_NODE = "KernelsTriton"


def _compiled(signature, **metadata):
    defaults = {"num_ctas": 1, "global_scratch_size": 0, "profile_scratch_size": 0,
                "launch_cooperative_grid": False, "launch_pdl": False}
    return SimpleNamespace(src=SimpleNamespace(signature=signature),
                           metadata=SimpleNamespace(**{**defaults, **metadata}))


def test_arg_types_letters_follow_the_launcher_abi():
    signature = {"X": "*bf16", "W": "*fp32", "n": "i32", "big": "i64", "eps": "fp32", "BLOCK": "constexpr"}
    assert _cpp_extension.arg_types(_compiled(signature)) == "ppilf"


@pytest.mark.parametrize(("signature", "metadata"), [
    ({"X": "*bf16"}, {"num_ctas": 2}),
    ({"X": "*bf16"}, {"global_scratch_size": 128}),
    ({"X": "*bf16"}, {"profile_scratch_size": 64}),
    ({"X": "*bf16"}, {"launch_cooperative_grid": True}),
    ({"X": "*bf16"}, {"launch_pdl": True}),
    ({"X": "*bf16", "h": "fp16"}, {}),
    ({"X": "*bf16", "d": "nvTmaDesc"}, {}),
    ({"X": ("*bf16", "*bf16")}, {}),
], ids=["cluster", "global_scratch", "profile_scratch", "cooperative", "pdl", "fp16_scalar", "tma", "tuple"])
def test_arg_types_refuses_launches_the_extension_does_not_reproduce(signature, metadata):
    assert _cpp_extension.arg_types(_compiled(signature, **metadata)) is None


@pytest.fixture
def fresh_state(monkeypatch):
    """The module's build state as in a new process."""
    for name, value in (("_thread", None), ("_module", None), ("_failure", None)):
        monkeypatch.setattr(_cpp_extension, name, value)
    return _cpp_extension


def test_switch_off_by_environment(fresh_state, monkeypatch):
    monkeypatch.setenv(_cpp_extension.ENV_SWITCH, "0")
    assert fresh_state.extension(wait=True) is None
    assert fresh_state.status() == "disabled"
    assert fresh_state.failure() == f"disabled: {_cpp_extension.ENV_SWITCH}=0"


def test_never_used_with_a_rocm_torch(fresh_state, monkeypatch):
    monkeypatch.delenv(_cpp_extension.ENV_SWITCH, raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert fresh_state.extension(wait=True) is None
    assert "ROCm" in fresh_state.failure()


def test_a_failed_build_leaves_the_python_path_and_says_why(fresh_state, monkeypatch, caplog):
    monkeypatch.delenv(_cpp_extension.ENV_SWITCH, raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)

    def broken():
        raise OSError("no C++ compiler")

    monkeypatch.setattr(fresh_state, "load_extension", broken)
    with caplog.at_level("WARNING", logger=_cpp_extension.__name__):
        assert fresh_state.extension(wait=True) is None
    assert fresh_state.status() == "failed"
    assert "OSError: no C++ compiler" in fresh_state.failure()
    assert "could not be built (OSError: no C++ compiler)" in caplog.text


def _can_build() -> str | None:
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (kernels-cuda depends on the ninja package)"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler on this machine"
    return None


@pytest.mark.skipif(_can_build() is not None, reason=f"cannot build C++ extensions here: {_can_build()}")
def test_source_builds_against_this_torch_and_validates_argument_letters():
    # About a minute on a CPU-only CI machine: the source must compile against the torch CI installs, even though
    # only a GPU can run it.
    module = _cpp_extension.load_extension()
    kernel = module.Kernel(function=1, threads=128, shared_bytes=0, arg_types="pplif")
    plan = module.NormPlan()
    plan.forward = kernel
    assert plan.forward.arg_types == "pplif"
    with pytest.raises(RuntimeError, match=r"unknown argument type 'x'; allowed: p, i, l, f"):
        module.Kernel(function=1, threads=128, shared_bytes=0, arg_types="px")
    with pytest.raises(RuntimeError, match="null kernel function"):
        module.Kernel(function=0, threads=128, shared_bytes=0, arg_types="p")
    with pytest.raises(RuntimeError, match=r"15 arguments; at most 14"):
        module.Kernel(function=1, threads=128, shared_bytes=0, arg_types="p" * 15)
    # A NormCall (plan + launch shapes, what Python passes to every call) checks what it is given.
    with pytest.raises(RuntimeError, match="needs a plan with its forward, backward and sum_partials kernels"):
        module.NormCall(plan, forward_grid=1, programs=1, rows_per_program=1)
    plan.backward = plan.sum_partials = kernel
    plan.sum_block_columns = 64
    with pytest.raises(RuntimeError, match="positive forward grid, program count and rows per program"):
        module.NormCall(plan, forward_grid=1, programs=0, rows_per_program=1)
    call = module.NormCall(plan, forward_grid=3, programs=2, rows_per_program=5)
    assert (call.forward_grid, call.programs, call.rows_per_program) == (3, 2, 5)
    # Inputs are checked before anything is launched: a CPU input can never be right (Python keeps no entry for
    # CPU signatures), so it is an error rather than a declined call.
    with pytest.raises(RuntimeError, match="expected a CUDA input, got one on cpu"):
        module.rms_norm(torch.ones(2, 64), torch.ones(64), 1e-6, 0.0, call)


class _FailingExtension:
    """An extension whose calls fail as a launch on a broken context would."""

    def rms_norm(self, *args):
        raise RuntimeError("kernels-triton autograd extension: cuLaunchKernel failed with CUresult 201")

    residual_rms_norm = rms_norm


@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "residual_rms_norm"])
def test_a_failing_call_falls_back_to_python_autograd_for_good(triton_kernels, fresh_state, monkeypatch, caplog,
                                                               residual):
    # An automatic choice: the call still returns the right result (the Python autograd path), says why once,
    # and the extension is not used again in this process. On CPU the kernels run in Triton's interpreter.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from kernels_triton import _residual_rms_norm
    from kernels_triton import _rms_norm

    monkeypatch.setattr(fresh_state, "_module", _FailingExtension())
    monkeypatch.setattr(fresh_state, "_ENTRIES", {})
    monkeypatch.setattr(fresh_state, "_prepare", lambda extension, residual, *args: (
        extension.residual_rms_norm if residual else extension.rms_norm, None))
    # CPU tensors in the interpreter: let the adapters take the kernels there.
    monkeypatch.setattr(_rms_norm, "rms_norm_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(_residual_rms_norm, "residual_rms_norm_supported", lambda *args, **kwargs: True)
    x = torch.randn(4, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    with caplog.at_level("WARNING", logger=_cpp_extension.__name__):
        if residual:
            y, _ = _residual_rms_norm.eager_residual_rms_norm(x, torch.zeros_like(x), w, eps=1e-6, offset=0.0,
                                                              casting="llama")
        else:
            y = _rms_norm.eager_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")
    expected = x.detach() * torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y.detach(), expected, rtol=1e-5, atol=1e-5)
    assert "RMSNormBackward" in y.grad_fn.name() and not y.grad_fn.name().startswith(CPP_NODE)
    assert fresh_state.status() == "failed" and fresh_state.extension() is None
    assert "CUresult 201" in fresh_state.failure()
    assert "using the Python autograd path from now on" in caplog.text


class _RecordingExtension:
    """An extension whose calls return their input unchanged and are counted."""

    def __init__(self):
        self.calls = 0

    def rms_norm(self, x, *args):
        self.calls += 1
        return x


def test_python_autograd_takes_the_python_path_inside_the_block_only(triton_kernels, fresh_state, monkeypatch):
    # The benchmarks' side-by-side switch: inside the block (nested too) the adapters' eager calls never reach
    # the extension; after it, and after an exception in it, they do again.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from kernels_triton import _rms_norm

    extension = _RecordingExtension()
    monkeypatch.setattr(fresh_state, "_module", extension)
    monkeypatch.setattr(fresh_state, "_ENTRIES", {})
    monkeypatch.setattr(fresh_state, "_prepare", lambda loaded, residual, *args: (loaded.rms_norm, None))
    monkeypatch.setattr(_rms_norm, "rms_norm_supported", lambda *args, **kwargs: True)  # CPU: the interpreter
    x = torch.randn(4, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device)

    def norm():
        return _rms_norm.eager_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")

    with fresh_state.python_autograd():
        with fresh_state.python_autograd():
            inner = norm()
        outer = norm()
    assert extension.calls == 0
    assert type(inner.grad_fn).__name__ == type(outer.grad_fn).__name__ == "_RMSNormBackward"
    assert norm() is x and extension.calls == 1
    with pytest.raises(ValueError, match="inside"), fresh_state.python_autograd():
        raise ValueError("inside")
    assert norm() is x and extension.calls == 2


def test_norm_call_is_the_prepared_entry_or_none(fresh_state, monkeypatch):
    x, w = torch.randn(3, 64), torch.ones(64)
    assert fresh_state.norm_call(x, w) is None  # not loaded
    monkeypatch.setattr(fresh_state, "_module", _RecordingExtension())
    asked = []
    monkeypatch.setattr(fresh_state, "_prepare", lambda *args: asked.append(args) or ("function", "call"))
    assert fresh_state.norm_call(x, w, casting="gemma", offset=1.0) == ("function", "call")
    assert asked[0][1:] == (False, x.shape, x.dtype, w.dtype, True, True, -1)
    monkeypatch.setattr(fresh_state, "_prepare", lambda *args: False)  # a signature the extension cannot take
    assert fresh_state.norm_call(x, w, residual=True) is None


# ------------------------------------------------------------------------------------------- on a GPU


@pytest.fixture
def cpp_ready():
    extension = _cpp_extension.extension(wait=True)
    if extension is None:
        pytest.fail(f"the extension should build on a GPU machine: {_cpp_extension.failure()}")
    from types import SimpleNamespace

    from kernels_triton import _residual_rms_norm
    from kernels_triton import _rms_norm

    def rms_norm(x, w, *, eps, offset, gemma):
        return _rms_norm.eager_rms_norm(x, w, eps=eps, offset=offset, casting="gemma" if gemma else "llama")

    def residual_rms_norm(x, r, w, *, eps, offset, gemma):
        return _residual_rms_norm.eager_residual_rms_norm(x, r, w, eps=eps, offset=offset,
                                                          casting="gemma" if gemma else "llama")

    # The adapters' eager entries with autograd, which take the C++ nodes when they can.
    return SimpleNamespace(rms_norm=rms_norm, residual_rms_norm=residual_rms_norm)


def _python_path(monkeypatch, triton_kernels):
    monkeypatch.setattr(_cpp_extension, "eager_norm", lambda *args, **kwargs: None)


def _run(fn, inputs, grads):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward([o for o, g in zip(outputs, grads, strict=True) if g is not None],
                            [g for g in grads if g is not None])
    return outputs, [leaf.grad for leaf in leaves]


def _assert_identical(cpp, python, what):
    for index, (a, b) in enumerate(zip(cpp, python, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, f"{what}[{index}]: one path has no value"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{index}]: {a.dtype}{tuple(a.shape)}"
        assert torch.equal(a, b), f"{what}[{index}]: max difference {(a.float() - b.float()).abs().max().item()}"


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 37, 1000), (257, 4096), (5, 128), (1, 7)], ids=str)
@pytest.mark.parametrize(("offset", "gemma"), [(0.0, False), (1.0, True), (1.0, False)],
                         ids=["llama", "gemma", "llama_offset"])
def test_rms_norm_cpp_path_is_bit_identical_to_python_path(cpp_ready, monkeypatch, dtype, shape, offset, gemma):
    triton_kernels = cpp_ready
    x = torch.randn(shape, device="cuda", dtype=dtype) * 3
    w = torch.randn(shape[-1], device="cuda", dtype=dtype) * 0.2 + 1
    dy = torch.randn(shape, device="cuda", dtype=dtype)

    def norm(x, w):
        return triton_kernels.rms_norm(x, w, eps=1e-6, offset=offset, gemma=gemma)

    cpp_out, cpp_grads = _run(norm, (x, w), (dy,))
    assert cpp_out[0].grad_fn.name() == f"{CPP_NODE}RMSNormBackward", cpp_out[0].grad_fn.name()
    _python_path(monkeypatch, triton_kernels)
    python_out, python_grads = _run(norm, (x, w), (dy,))
    assert not python_out[0].grad_fn.name().startswith(CPP_NODE)
    _assert_identical(cpp_out, python_out, "output")
    _assert_identical(cpp_grads, python_grads, "gradients (x, weight)")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("grads", ["both", "normed_only", "sum_only"])
def test_residual_rms_norm_cpp_path_is_bit_identical_to_python_path(cpp_ready, monkeypatch, dtype, grads):
    triton_kernels = cpp_ready
    shape = (3, 41, 1000)
    x, r = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    w = torch.randn(1000, device="cuda", dtype=dtype) * 0.2 + 1
    dy, ds = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    upstream = {"both": (dy, ds), "normed_only": (dy, None), "sum_only": (None, ds)}[grads]

    def norm(x, r, w):
        return triton_kernels.residual_rms_norm(x, r, w, eps=1e-6, offset=0.0, gemma=False)

    cpp_out, cpp_grads = _run(norm, (x, r, w), upstream)
    assert cpp_out[0].grad_fn.name() == f"{CPP_NODE}ResidualRMSNormBackward"
    _python_path(monkeypatch, triton_kernels)
    python_out, python_grads = _run(norm, (x, r, w), upstream)
    _assert_identical(cpp_out, python_out, "outputs (normed, sum)")
    _assert_identical(cpp_grads, python_grads, "gradients (x, residual, weight)")
    if grads == "sum_only":
        assert torch.equal(cpp_grads[0], ds) and cpp_grads[2] is None


@requires_cuda
@pytest.mark.parametrize("path", ["cpp", "python"])
@pytest.mark.parametrize("residual", [False, True], ids=["rms_norm", "residual_rms_norm"])
def test_forward_with_autograd_allocates_only_its_outputs(cpp_ready, monkeypatch, path, residual):
    # Both eager autograd paths save no rstd (the backward recomputes it): recording the node allocates the
    # outputs and nothing else. 64 rows of 1000 bfloat16 are whole 512-byte allocator blocks, so a float32 per
    # row (256 bytes, one more block) would show.
    triton_kernels = cpp_ready
    if path == "python":
        _python_path(monkeypatch, triton_kernels)
    x, r = (torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def norm():
        if residual:
            return triton_kernels.residual_rms_norm(x, r, w, eps=1e-6, offset=0.0, gemma=False)
        return (triton_kernels.rms_norm(x, w, eps=1e-6, offset=0.0, gemma=False),)

    norm()  # compiles the kernels and builds the launch plan outside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outputs = norm()
    assert outputs[0].grad_fn.name().startswith(CPP_NODE) == (path == "cpp"), outputs[0].grad_fn.name()
    assert torch.cuda.memory_allocated() - before == sum(o.numel() * o.element_size() for o in outputs)


@requires_cuda
def test_cpp_path_copies_a_misaligned_upstream_gradient(cpp_ready):
    # The backward kernel was compiled for 16-byte aligned gradients; a gradient that is an offset view of a
    # larger buffer must still give the right answer (the C++ backward copies it).
    triton_kernels = cpp_ready
    x = torch.randn(6, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    buffer = torch.randn(6 * 512 + 1, device="cuda", dtype=torch.bfloat16)
    dy = buffer[1:].view(6, 512)
    assert dy.data_ptr() % 16 != 0
    y = triton_kernels.rms_norm(x, w, eps=1e-6, offset=0.0, gemma=False)
    assert y.grad_fn.name().startswith(CPP_NODE)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    torch.testing.assert_close(x.grad.double(), dx64, rtol=1.6e-2, atol=1.6e-2)


@requires_cuda
def test_extension_declines_inputs_its_kernels_do_not_take(cpp_ready):
    # Python looks a call's entry up by shape, dtypes and device; the extension checks the rest per call and returns
    # None (the caller then takes the Python path) instead of launching kernels compiled for dense, 16-byte
    # aligned tensors on memory they would misread.
    x = torch.randn(6, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    extension = _cpp_extension.extension()
    norm, call = _cpp_extension._prepare(extension, False, x.shape, x.dtype, w.dtype, False, False, x.get_device())
    residual_norm, residual_call = _cpp_extension._prepare(extension, True, x.shape, x.dtype, w.dtype, False, False,
                                                                 x.get_device())
    assert norm(x, w, 1e-6, 0.0, call) is not None
    assert residual_norm(x, x, w, 1e-6, 0.0, residual_call) is not None
    misaligned = torch.randn(6 * 512 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(6, 512)
    transposed = torch.randn(512, 6, device="cuda", dtype=torch.bfloat16).t()
    declined = {
        "misaligned input": (misaligned, w),
        "non-contiguous input": (transposed, w),
        "weight of another width": (x, torch.ones(256, device="cuda", dtype=torch.bfloat16)),
        "strided weight": (x, torch.ones(1024, device="cuda", dtype=torch.bfloat16)[::2]),
        "misaligned weight": (x, torch.ones(513, device="cuda", dtype=torch.bfloat16)[1:]),
    }
    for what, (inputs, weight) in declined.items():
        assert norm(inputs, weight, 1e-6, 0.0, call) is None, what
    residuals = {
        "misaligned residual": misaligned,
        "non-contiguous residual": transposed,
        "residual of another shape": torch.randn(3, 512, device="cuda", dtype=torch.bfloat16),
        "residual of another dtype": torch.randn(6, 512, device="cuda", dtype=torch.float32),
    }
    for what, residual in residuals.items():
        assert residual_norm(x, residual, w, 1e-6, 0.0, residual_call) is None, what
    with pytest.raises(RuntimeError, match="expected a CUDA input, got one on cpu"):
        norm(x.detach().cpu(), w.detach().cpu(), 1e-6, 0.0, call)


@requires_cuda
def test_cpp_path_steps_aside_for_launch_hooks_and_misaligned_inputs(cpp_ready, monkeypatch):
    triton_kernels = cpp_ready
    w = torch.ones(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    misaligned = torch.randn(6 * 512 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(6, 512)
    y = triton_kernels.rms_norm(misaligned.requires_grad_(True), w, eps=1e-6, offset=0.0, gemma=False)
    assert not y.grad_fn.name().startswith(CPP_NODE), "a misaligned input must take the Python path"
    monkeypatch.setattr(_cpp_extension, "launch_hooks_registered", lambda: True)
    x = torch.randn(6, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = triton_kernels.rms_norm(x, w, eps=1e-6, offset=0.0, gemma=False)
    assert not y.grad_fn.name().startswith(CPP_NODE), "a registered launch hook must see every launch"


@requires_cuda
def test_cpp_node_frees_its_saved_tensors_and_detects_in_place_changes(cpp_ready):
    # What autograd guarantees for its own nodes holds for the C++ one: a second backward through a freed graph
    # raises, retain_graph keeps it (same gradients again), and an input changed in place after the forward is
    # refused at backward instead of giving wrong gradients.
    triton_kernels = cpp_ready
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    y = triton_kernels.rms_norm(x, w, eps=1e-6, offset=0.0, gemma=False)
    assert y.grad_fn.name().startswith(CPP_NODE)
    first = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    second = torch.autograd.grad(y, (x, w), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y, (x, w), dy)
    h = x.detach().clone().requires_grad_(True) * 1  # a non-leaf input that can be changed in place
    y = triton_kernels.rms_norm(h, w, eps=1e-6, offset=0.0, gemma=False)
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


@requires_cuda
def test_cpp_node_computes_only_the_gradients_asked_for(cpp_ready):
    triton_kernels = cpp_ready
    x = torch.randn(8, 256, device="cuda", dtype=torch.float32, requires_grad=True)
    w = torch.randn(256, device="cuda", dtype=torch.float32, requires_grad=True)
    frozen = w.detach()
    y = triton_kernels.rms_norm(x, frozen, eps=1e-6, offset=0.0, gemma=False)  # a frozen weight
    assert y.grad_fn.name().startswith(CPP_NODE)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    x64 = x.detach().double().requires_grad_(True)
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * frozen.double()
    (dx64,) = torch.autograd.grad(y64, x64, torch.ones_like(y64))
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-5)
    y = triton_kernels.rms_norm(x.detach(), w, eps=1e-6, offset=0.0, gemma=False)  # only the weight trains
    (dw,) = torch.autograd.grad(y, w, torch.ones_like(y))
    assert dw.shape == w.shape and torch.isfinite(dw).all()


@requires_cuda
def test_kernelized_path_takes_the_cpp_node_and_keeps_the_current_device(cpp_ready):
    # The adapters' eager fast path (kernels_triton._rms_norm.eager_rms_norm) goes straight to the C++ node; the
    # caller's current device is the same afterwards (the extension makes the input's device's context current
    # only for its launch).
    from kernels_triton import _residual_rms_norm as _residual
    from kernels_triton import _rms_norm

    x = torch.randn(4, 9, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    before = torch.cuda.current_device()
    for residual in (None, torch.randn_like(x)):
        if residual is None:
            out = _rms_norm.eager_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")
            expected = _rms_norm.apply_rms_norm(x, w, eps=1e-6, offset=0.0, gemma=False)
        else:
            out = _residual.eager_residual_rms_norm(x, residual, w, eps=1e-6, offset=0.0, casting="llama")[0]
            expected = _residual.apply_residual_rms_norm(x, residual, w, eps=1e-6, offset=0.0, gemma=False)[0]
        assert out.grad_fn.name().startswith(CPP_NODE), out.grad_fn.name()
        assert torch.equal(out, expected)
        assert torch.cuda.current_device() == before
    # Same signature, but an input the extension declines (misaligned): the Python node, the same values.
    misaligned = torch.randn(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view(x.shape).requires_grad_(True)
    out = _rms_norm.eager_rms_norm(misaligned, w, eps=1e-6, offset=0.0, casting="llama")
    assert not out.grad_fn.name().startswith(CPP_NODE), out.grad_fn.name()
    aligned = misaligned.detach().clone().requires_grad_(True)
    assert torch.equal(out, _rms_norm.eager_rms_norm(aligned, w, eps=1e-6, offset=0.0, casting="llama"))


def test_eager_path_remembers_a_signature_the_ready_extension_cannot_take(fresh_state, monkeypatch):
    # With the extension loaded, a signature it cannot take (2**31 rows, a kernel it cannot launch) is looked up
    # once and remembered; only while the extension builds is the answer left open for the next call.
    monkeypatch.setattr(fresh_state, "_module", object())
    monkeypatch.setattr(fresh_state, "_ENTRIES", {})
    asked = []
    monkeypatch.setattr(fresh_state, "_prepare", lambda *args: asked.append(args))  # None: cannot take

    def supported(*args, **kwargs):
        return True

    x, w = torch.randn(3, 64, requires_grad=True), torch.ones(64)
    for _ in range(3):
        assert fresh_state.eager_norm(x, None, w, 1e-6, 0.0, "llama", supported=supported) is None
    assert len(asked) == 1
    monkeypatch.setattr(fresh_state, "_module", None)
    monkeypatch.setattr(fresh_state, "_thread", object())  # building
    y = torch.randn(5, 64, requires_grad=True)
    for _ in range(2):
        assert fresh_state.eager_norm(y, None, w, 1e-6, 0.0, "llama", supported=supported) is None
    assert len(asked) == 1 and len(fresh_state._ENTRIES) == 1  # nothing prepared or remembered while it builds


def test_cpu_calls_never_start_the_build(fresh_state):
    # Autograd on CPU tensors takes the native path and leaves the extension alone (no compiler run on a laptop).
    from kernels_triton import _rms_norm

    x = torch.randn(3, 64, requires_grad=True)
    y = _rms_norm.eager_rms_norm(x, torch.ones(64), eps=1e-6, offset=0.0, casting="llama")
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, expected)
    assert fresh_state.status() == "not started"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("builder", ["dead", "alive", "old, unnamed", "fresh, unnamed", "none"])
def test_a_build_lock_left_by_a_stopped_process_is_removed(tmp_path, caplog, builder):
    """torch's build lock, left by a process that exited during the background build, would make every later
    build wait forever (the C++ path then never arrives, silently); a live builder's lock is kept."""
    lock = tmp_path / "lock"
    if builder != "none":
        lock.touch()
    if builder == "dead":
        (tmp_path / _cpp_extension._BUILDER_FILE).write_text(str(_dead_pid()))
    elif builder == "alive":
        (tmp_path / _cpp_extension._BUILDER_FILE).write_text(str(os.getpid()))
    elif builder == "old, unnamed":
        hour_ago = time.time() - 3600
        os.utime(lock, (hour_ago, hour_ago))
    with caplog.at_level(logging.WARNING, logger="kernels_triton._cpp_extension"):
        why = _cpp_extension.clear_stale_lock(tmp_path)
    removed = builder in ("dead", "old, unnamed")
    assert lock.exists() is (builder in ("alive", "fresh, unnamed"))
    assert (why is not None) is removed
    assert ("removed the C++ extension's build lock" in caplog.text) is removed
    if builder == "dead":
        assert "is gone" in why
