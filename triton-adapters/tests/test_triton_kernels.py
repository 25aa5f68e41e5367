"""kernels-triton's own Triton kernels against the eager transformers modules, forward and backward.

On a GPU the kernels run through their adapters (``kernels_triton._rms_norm``, ``_rotary``, ``_gated``) on CUDA
tensors. Without one, the same kernel code runs in Triton's interpreter on CPU tensors (test ids say ``interpreter``):
that checks the kernels' arithmetic, masking and strides, not their speed or GPU-specific behaviour. Tolerances follow
``conftest.assert_as_good_as_eager``: at most twice eager's distance from a float64 truth plus a per-dtype floor.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import DTYPES
from conftest import assert_upstream_gradient_untouched
from conftest import compare_with_eager
from conftest import eager_rotary


triton = pytest.importorskip("triton", reason="this package's own kernels need Triton (installed with liger-kernel)")

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
WHERE = "cuda" if ON_GPU else "interpreter"


@pytest.fixture(scope="module")
def kernels(triton_kernels):
    """The kernel functions: adapters on a GPU, the raw kernels in the interpreter on CPU."""
    _triton_kernels = triton_kernels
    if ON_GPU:
        from kernels_triton import _gated
        from kernels_triton import _rms_norm
        from kernels_triton import _rotary

        return SimpleNamespace(rms_norm=_rms_norm.rms_norm, rotary_embedding=_rotary.rotary_embedding,
                               silu_mul=_gated.silu_mul, gelu_tanh_mul=_gated.gelu_tanh_mul,
                               gate_up_activation=_gated.gate_up_activation)

    class Raw:
        @staticmethod
        def rms_norm(x, w, *, eps, offset, casting):
            return _triton_kernels.rms_norm(x, w, eps=eps, offset=offset, gemma=casting == "gemma")

        @staticmethod
        def rotary_embedding(q, k, cos, sin, unsqueeze_dim=1):
            return _triton_kernels.rotary(q, k, cos, sin)

        @staticmethod
        def silu_mul(gate, up):
            return _triton_kernels.gated_activation(gate, up, gelu=False)

        @staticmethod
        def gelu_tanh_mul(gate, up):
            return _triton_kernels.gated_activation(gate, up, gelu=True)

        gate_up_activation = staticmethod(_triton_kernels.gate_up_activation)

    return Raw


RMS_SHAPES = [(3, 37, 1000), (40, 128), (2, 5, 4096)] if ON_GPU else [(3, 37, 100), (40, 128), (3, 1000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=str)
@pytest.mark.parametrize("model", ["llama", "gemma", "llama_offset"])
def test_rms_norm_matches_eager(kernels, model, shape, dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = shape[-1]
    cls, offset, casting = {
        "llama": (LlamaRMSNorm, 0.0, "llama"),
        "gemma": (GemmaRMSNorm, 1.0, "gemma"),
        "llama_offset": (LlamaRMSNorm, 1.0, "llama"),  # (1 + w) with Llama's casting order
    }[model]

    def eager(x, w):
        m = cls(hidden, eps=1e-6).to(device=x.device, dtype=x.dtype)
        del m.weight
        m.weight = w + offset if model == "llama_offset" else w
        return m(x)

    def ours(x, w):
        return kernels.rms_norm(x, w, eps=1e-6, offset=offset, casting=casting)

    x = torch.randn(shape, device=DEV) * 2 + 0.3
    w = torch.randn(hidden, device=DEV) * 0.5 + (0.0 if offset else 1.0)
    compare_with_eager(ours, eager, [x], [w], dtype, f"{WHERE} {model} rms_norm {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary", [64, 32, 48], ids=["full", "partial", "partial_odd_pass"])
@pytest.mark.parametrize("layout", ["bhsd_view", "contiguous"])
def test_rotary_matches_eager(kernels, rotary, layout, dtype):
    # cos and sin halves differ on purpose: the kernel must not assume HF's duplicated frequencies.
    angles = torch.randn(1, 33, rotary, device=DEV)

    def eager(q, k):
        return eager_rotary(q, k, angles.cos().to(q.dtype), angles.sin().to(q.dtype))

    def ours(q, k):
        return kernels.rotary_embedding(q, k, angles.cos().to(q.dtype), angles.sin().to(q.dtype))

    if layout == "bhsd_view":  # the projection layout [B, S, H, D] viewed as [B, H, S, D], as attentions pass it
        q = torch.randn(2, 33, 6, 64, device=DEV).transpose(1, 2)
        k = torch.randn(2, 33, 2, 64, device=DEV).transpose(1, 2)
    else:
        q = torch.randn(2, 6, 33, 64, device=DEV)
        k = torch.randn(2, 2, 33, 64, device=DEV)
    compare_with_eager(ours, eager, [q, k], [], dtype, f"{WHERE} rope {rotary} {layout}")
    q_in, k_in = q.to(dtype), k.to(dtype)
    q_keep = q_in.clone()
    q_out, _ = ours(q_in, k_in)
    assert torch.equal(q_in, q_keep), "the kernel modified its input"
    assert q_out.stride() == q_in.stride(), "outputs keep the input layout, as eager's elementwise math does"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation_matches_eager(kernels, act, dtype):
    import torch.nn.functional as F

    def eager(gate, up):
        return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up

    fn = kernels.silu_mul if act == "silu" else kernels.gelu_tanh_mul
    # 3 * 41 * 333 elements: not a multiple of the kernel's block; large |gate| checks tanh/sigmoid saturation.
    gate = torch.randn(3, 41, 333, device=DEV) * 4
    up = torch.randn(3, 41, 333, device=DEV)
    compare_with_eager(fn, eager, [gate, up], [], dtype, f"{WHERE} {act} gated activation")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(37, 2 * 40), (2, 5, 2 * 768)], ids=["ragged_rows", "whole_blocks"])
def test_gate_up_activation_matches_eager(kernels, act, shape, dtype):
    # The MoE experts' concatenated [gate | up] projection: rows of 40 are masked; rows of 768 fill 256-wide blocks.
    import torch.nn.functional as F

    def eager(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up

    gate_up = torch.randn(shape, device=DEV) * 3
    compare_with_eager(lambda t: kernels.gate_up_activation(t, gelu=act == "gelu_tanh"), eager, [gate_up], [],
                       dtype, f"{WHERE} {act} concatenated gated activation")


def test_gate_up_activation_writes_the_gradient_over_an_intermediate_only(kernels):
    import torch.nn.functional as F

    leaf = torch.randn(6, 2 * 48, device=DEV, requires_grad=True)
    keep = leaf.detach().clone()
    kernels.gate_up_activation(leaf, gelu=False).sum().backward()
    assert torch.equal(leaf.detach(), keep), "a leaf input was overwritten"
    base = torch.randn(6, 2 * 48, device=DEV, requires_grad=True)
    middle = base * 2
    out = kernels.gate_up_activation(middle, gelu=False)
    out.backward(torch.ones_like(out))
    gate, up = (2 * base.detach()).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    expected = 2 * torch.cat([up * sig * (1 + gate * (1 - sig)), F.silu(gate)], dim=-1)
    torch.testing.assert_close(base.grad, expected, rtol=1e-4, atol=1e-5)
    assert middle._version > 0, "the intermediate's storage took its gradient and its version was bumped"


def test_rms_norm_leaves_the_upstream_gradient_alone(kernels):
    assert_upstream_gradient_untouched(kernels.rms_norm, DEV)


def test_rms_norm_without_autograd_matches_with_it(kernels):
    x = torch.randn(9, 200, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(200, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        inference = kernels.rms_norm(x, w, eps=1e-5, offset=0.0, casting="llama")
    training = kernels.rms_norm(x.requires_grad_(True), w, eps=1e-5, offset=0.0, casting="llama")
    assert torch.equal(inference, training.detach())


def test_gated_backward_reuses_only_intermediate_storage(kernels):
    # Leaves the caller owns keep their values; intermediates of the graph give their storage to the gradients.
    gate = torch.randn(4, 96, device=DEV, requires_grad=True)
    up = torch.randn(4, 96, device=DEV, requires_grad=True)
    keep = gate.detach().clone()
    kernels.silu_mul(gate, up).sum().backward()
    assert torch.equal(gate.detach(), keep), "a leaf input was overwritten"
    base = torch.randn(4, 96, device=DEV, requires_grad=True)
    gate_mid, up_mid = base * 2, base * 3
    kernels.silu_mul(gate_mid, up_mid).sum().backward()
    expected = 2 * torch.sigmoid(2 * base.detach()) * (1 + 2 * base.detach() * (1 - torch.sigmoid(2 * base.detach())))
    torch.testing.assert_close(base.grad, expected * 3 * base.detach() + torch.nn.functional.silu(2 * base.detach())
                               * 3, rtol=1e-4, atol=1e-5)


def test_gated_backward_makes_a_second_reader_of_the_reused_storage_raise(kernels):
    base = torch.randn(4, 96, device=DEV, requires_grad=True)
    gate = base * 2
    squared = gate * gate  # saves gate; created first, so its backward runs after the kernel's
    out = kernels.silu_mul(gate, base * 3).sum() + squared.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


@pytest.mark.skipif(not ON_GPU, reason="compiled kernels need a GPU (the interpreter does not specialise)")
def test_rms_norm_forward_at_any_row_count_after_the_first_compile():
    # Row counts are unspecialised, so one compiled kernel serves them all; each call must still compute its own
    # rows, including 1 row (which Triton would otherwise specialise on).
    import torch.nn.functional as F
    from kernels_triton import _rms_norm

    w = torch.randn(1024, device=DEV, dtype=torch.bfloat16)
    for rows in (1000, 1024, 1, 4097, 1000):
        x = torch.randn(rows, 1024, device=DEV, dtype=torch.bfloat16)
        with torch.no_grad():
            ours = _rms_norm.apply_rms_norm(x, w, eps=1e-6, offset=0.0, gemma=False)
            expected = F.rms_norm(x.float(), (1024,), eps=1e-6).to(x.dtype) * w
        torch.testing.assert_close(ours, expected, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("rows", [4, 3], ids=["block_multiple", "ragged"])
def test_gated_activation_even_and_ragged_lengths(kernels, rows):
    # 4 x 512 elements fill whole 1024-element blocks (the unmasked path); 3 x 512 leave a partial one.
    import torch.nn.functional as F

    gate = torch.randn(rows, 512, device=DEV, requires_grad=True)
    up = torch.randn(rows, 512, device=DEV, requires_grad=True)
    out = kernels.silu_mul(gate, up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    torch.testing.assert_close(up.grad, F.silu(gate.detach()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rstd_source", ["saved", "recomputed"])
@pytest.mark.parametrize(("programs_per_sm", "tile_bytes", "stages"),
                         [(1, 4096, 1), (2, 8192, 3), (4, 16384, 2), (8, 4096, 3)])
def test_rms_norm_backward_launch_shapes_agree_with_float64(triton_kernels, programs_per_sm, tile_bytes, stages,
                                                            rstd_source):
    # Every launch shape the tiling sweep tries must compute the same gradients: ragged row blocks (37 rows over
    # 1-64-row tiles and 4-32 programs), a width that is no power of two, the weight-gradient sum over any number
    # of per-program rows; with the forward's saved rstd (the torch.compile ops) or the rstd recomputed in the
    # backward (the eager paths), whose rows past the end must not turn the weight gradient into NaN (on the GPU
    # eps is 0, which makes their recomputed rstd infinite; Triton's interpreter raises on that division, so it
    # gets 1e-6). Float32 against a float64 autograd truth.
    rows, cols, eps = 37, 200, 0.0 if ON_GPU else 1e-6
    x = torch.randn(rows, cols, device=DEV) * 2 + 0.3
    w = torch.randn(cols, device=DEV) * 0.5 + 1.0
    dy = torch.randn(rows, cols, device=DEV)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    _, rstd = triton_kernels.rms_norm_forward(x, w, eps, 0.0, False, store_rstd=True)
    tiling = triton_kernels.norm_backward_tiling(rows, cols, x.element_size(), x.get_device(),
                                                  programs_per_sm=programs_per_sm, tile_bytes=tile_bytes,
                                                  stages=stages)
    if rstd_source == "recomputed":
        dx, dw = triton_kernels.add_rms_norm_backward(dy, None, x, w, None, 0.0, False, want_dw=True, eps=eps,
                                                      tiling=tiling)
    else:
        dx, dw = triton_kernels.add_rms_norm_backward(dy, None, x, w, rstd, 0.0, False, want_dw=True, tiling=tiling)
    assert tiling[3] > 1, "the shape should spread rows over several programs"
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-4)
    assert dw.dtype == w.dtype and dw.shape == w.shape


def test_rms_norm_backward_takes_exactly_one_rstd_source(triton_kernels):
    x = torch.randn(4, 64, device=DEV)
    w, dy = torch.ones(64, device=DEV), torch.randn(4, 64, device=DEV)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6)
    with pytest.raises(ValueError, match="either the saved rstd or the eps to recompute it, not both"):
        triton_kernels.add_rms_norm_backward(dy, None, x, w, rstd, 0.0, False, want_dw=True, eps=1e-6)
    with pytest.raises(ValueError, match="not neither"):
        triton_kernels.add_rms_norm_backward(dy, None, x, w, None, 0.0, False, want_dw=True)


@pytest.mark.parametrize("hooks", ["none", "enter", "exit", "no_knobs"])
def test_launch_hooks_are_seen_so_profilers_see_every_launch(triton_kernels, monkeypatch, hooks):
    # The C++ autograd nodes launch through the driver; a registered Triton hook (a profiler) must still see every
    # launch, so they step aside whenever one is registered, or when this Triton cannot say.
    from kernels_triton import _launch

    enter, leave = SimpleNamespace(calls=[]), SimpleNamespace(calls=[])
    if hooks == "enter":
        enter.calls.append(print)
    elif hooks == "exit":
        leave.calls.append(print)
    runtime = None if hooks == "no_knobs" else SimpleNamespace(launch_enter_hook=enter, launch_exit_hook=leave)
    monkeypatch.setattr(_launch, "_RUNTIME", runtime)
    assert _launch.launch_hooks_registered() is (hooks != "none")
