"""kernels-triton's fused residual add + RMSNorm (the ``residual_rms_norm`` kind) against the eager layer ops.

Eagerly a pre-norm decoder layer computes ``new = residual + x`` in the input dtype and then its
``post_attention_layernorm(new)``; the new residual also feeds the layer's final add, so both outputs carry an upstream
gradient here. On a GPU the kernels run through their adapter (``kernels_triton._residual_rms_norm``); without one the
same kernel code runs in Triton's interpreter on CPU tensors (ids say ``interpreter``), which checks arithmetic,
masking and strides, not speed. Under the interpreter a float32 -> bfloat16 cast truncates instead of rounding to
nearest even (the compiled kernel rounds like eager), so bfloat16 sums may differ from eager's by one unit in the last
place there: every comparison uses ``conftest.assert_as_good_as_eager``'s bounds (at most twice eager's distance from a
float64 truth, plus a per-dtype floor of a few units of roundoff), never bit equality.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES
from conftest import assert_as_good_as_eager
from conftest import compare_with_eager
from conftest import requires_cuda


ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
WHERE = "cuda" if ON_GPU else "interpreter"
BACKEND = "inductor" if ON_GPU else "aot_eager"

# (norm class, offset, casting): Llama's, Gemma's (1 + w in float32) and a (1 + w) norm with Llama's rounding.
MODELS = {
    "llama": ("transformers.models.llama.modeling_llama.LlamaRMSNorm", 0.0, "llama"),
    "gemma": ("transformers.models.gemma.modeling_gemma.GemmaRMSNorm", 1.0, "gemma"),
    "llama_offset": ("transformers.models.llama.modeling_llama.LlamaRMSNorm", 1.0, "llama"),
}


def _norm_class(path: str) -> type[torch.nn.Module]:
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _eager(model: str):
    """The eager layer ops: ``new = residual + x``, then the transformers norm module on it."""
    path, offset, _ = MODELS[model]
    cls = _norm_class(path)

    def eager(x, residual, w):
        norm = cls(x.shape[-1], eps=1e-6).to(device=x.device, dtype=x.dtype)
        del norm.weight
        norm.weight = w + offset if model == "llama_offset" else w
        new_residual = residual + x
        return norm(new_residual), new_residual

    return eager


@pytest.fixture(scope="module")
def fused(triton_kernels):
    """``fn(x, residual, w, *, eps, offset, casting)``: the adapter on a GPU, the raw kernel in the interpreter."""
    if ON_GPU:
        from kernels_triton import _residual_rms_norm

        return _residual_rms_norm.residual_rms_norm

    def raw(x, residual, w, *, eps, offset, casting):
        return triton_kernels.residual_rms_norm(x, residual, w, eps=eps, offset=offset, gemma=casting == "gemma")

    return raw


def _inputs(rows: int, hidden: int, offset: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    # Activations of a few units (a residual stream grows along the layers); weights around 1 (or 0 for 1 + w).
    x = torch.randn(rows, hidden, device=DEV) * 2 + 0.3
    residual = torch.randn(rows, hidden, device=DEV) * 3
    w = torch.randn(hidden, device=DEV) * 0.5 + (0.0 if offset else 1.0)
    return [x, residual], [w]


# Rows: one, odd, and more than one program's block; widths: a power of two, odd, three-digit and Llama-size.
ROWS = (1, 7, 33)
HIDDEN = (64, 100, 1000, 4096)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
def test_llama_forward_and_backward_match_eager(fused, rows, hidden, dtype):
    inputs, params = _inputs(rows, hidden, 0.0)
    compare_with_eager(lambda x, r, w: fused(x, r, w, eps=1e-6, offset=0.0, casting="llama"), _eager("llama"),
                       inputs, params, dtype, f"{WHERE} residual_rms_norm llama [{rows}, {hidden}]")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (2, 17, 100)], ids=str)
@pytest.mark.parametrize("model", ["gemma", "llama_offset"])
def test_offset_norms_match_eager(fused, model, shape, dtype):
    _, offset, casting = MODELS[model]
    inputs, params = _inputs(1, shape[-1], offset)
    inputs = [torch.randn(shape, device=DEV) * 2 + 0.3, torch.randn(shape, device=DEV) * 3]
    compare_with_eager(lambda x, r, w: fused(x, r, w, eps=1e-6, offset=offset, casting=casting), _eager(model),
                       inputs, params, dtype, f"{WHERE} residual_rms_norm {model} {shape}")


def test_inputs_and_upstream_gradients_are_left_alone(fused):
    x = torch.randn(9, 256, device=DEV, requires_grad=True)
    residual = torch.randn(9, 256, device=DEV, requires_grad=True)
    w = torch.ones(256, device=DEV, requires_grad=True)
    keep = (x.detach().clone(), residual.detach().clone())
    normed, new_residual = fused(x, residual, w, eps=1e-6, offset=0.0, casting="llama")
    assert torch.equal(x.detach(), keep[0]) and torch.equal(residual.detach(), keep[1])
    dy, ds = torch.randn_like(normed), torch.randn_like(new_residual)
    grads = (dy.clone(), ds.clone())
    torch.autograd.backward((normed, new_residual), (dy, ds))
    assert torch.equal(dy, grads[0]) and torch.equal(ds, grads[1])
    # The sum's gradient is both inputs' (as eager's add hands one gradient tensor to both of its inputs).
    assert torch.equal(x.grad, residual.grad)


# (which inputs require a gradient, which outputs are used); the sum alone does not depend on the weight.
PARTIAL = [(needs, used) for needs in ("x", "residual", "weight", "all") for used in ("normed", "new_residual", "both")
           if (needs, used) != ("weight", "new_residual")]


@pytest.mark.parametrize(("needs", "used"), PARTIAL)
def test_partial_gradients(fused, used, needs):
    # Only some inputs require a gradient (a frozen norm, the first layer's residual), only one output is used.
    torch.manual_seed(0)
    base = [torch.randn(5, 40, device=DEV) * 2, torch.randn(5, 40, device=DEV), torch.randn(40, device=DEV) + 1]
    names = ("x", "residual", "weight")

    def run(fn):
        leaves = [t.clone().requires_grad_(needs in (name, "all")) for t, name in zip(base, names, strict=True)]
        normed, new_residual = fn(*leaves)
        picked = {"normed": normed.square().sum(), "new_residual": (new_residual * 3).sum(),
                  "both": normed.square().sum() + (new_residual * 3).sum()}[used]
        picked.backward()
        return [leaf.grad for leaf in leaves]

    ours = run(lambda x, r, w: fused(x, r, w, eps=1e-6, offset=0.0, casting="llama"))
    eager = run(_eager("llama"))
    for name, o, e in zip(names, ours, eager, strict=True):
        if e is None:
            assert o is None or not o.abs().max() > 0, name
            continue
        assert o is not None, f"no gradient for {name}"
        torch.testing.assert_close(o, e, rtol=1e-4, atol=1e-5)


def test_without_autograd_matches_with_it(fused):
    x, residual = (torch.randn(9, 200, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(200, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        inference = fused(x, residual, w, eps=1e-5, offset=0.0, casting="llama")
    training = fused(x.requires_grad_(True), residual, w, eps=1e-5, offset=0.0, casting="llama")
    for a, b in zip(inference, training, strict=True):
        assert torch.equal(a, b.detach())


def test_strided_inputs_are_read_correctly(fused):
    # A view with a row stride wider than the row (a slice of a wider tensor) is copied to dense rows first.
    wide = torch.randn(6, 160, device=DEV)
    x, residual = wide[:, :80], wide[:, 80:]
    w = torch.randn(80, device=DEV)
    normed, new_residual = fused(x, residual, w, eps=1e-6, offset=0.0, casting="llama")
    expected = _eager("llama")(x, residual, w)
    torch.testing.assert_close(new_residual, expected[1])
    torch.testing.assert_close(normed, expected[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- under torch.compile


@pytest.fixture(scope="module")
def ops(triton_kernels):
    from types import SimpleNamespace

    from kernels_triton import _gated
    from kernels_triton import _residual_rms_norm
    from kernels_triton import _rms_norm
    from kernels_triton import _rotary

    return SimpleNamespace(rms_norm=_rms_norm.rms_norm_op, residual_rms_norm=_residual_rms_norm.residual_rms_norm_op,
                           rotary=_rotary.rotary_op, gated_activation=_gated.gated_op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(ops, dtype):
    x = torch.randn(6, 40, device=DEV, dtype=dtype, requires_grad=True)
    r = torch.randn(6, 40, device=DEV, dtype=dtype, requires_grad=True)
    w = torch.randn(40, device=DEV, dtype=dtype, requires_grad=True)
    for offset, gemma in ((0.0, False), (1.0, True)):
        torch.library.opcheck(torch.ops.kernels_triton.add_rms_norm, (x, r, w, 1e-6, offset, gemma))
    # The backward op is not differentiable again (no double backward): checked without requires_grad.
    x_, r_, w_ = x.detach(), r.detach(), w.detach()
    _, s, rstd = torch.ops.kernels_triton.add_rms_norm(x_, r_, w_, 1e-6, 1.0, True)
    dy = torch.randn_like(x_)
    for ds in (torch.randn_like(x_), None):
        torch.library.opcheck(torch.ops.kernels_triton.add_rms_norm_backward, (dy, ds, s, w_, rstd, 1.0, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_compiled_matches_eager(ops, model, dtype):
    _, offset, casting = MODELS[model]
    eager_ops = _eager(model)

    def eager(x, r, w):
        # As in a decoder layer: the normalised sum feeds the MLP, the sum the final residual add.
        normed, new_residual = eager_ops(x, r, w)
        return normed * 2 + new_residual

    def fn(x, r, w):
        normed, new_residual = ops.residual_rms_norm(x, r, w, eps=1e-6, offset=offset, gemma=casting == "gemma")
        return normed * 2 + new_residual

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=BACKEND)
    inputs = [torch.randn(3, 37, 100, device=DEV) * 2 + 0.3, torch.randn(3, 37, 100, device=DEV) * 3]
    params = [torch.randn(100, device=DEV) * 0.5 + (0.0 if offset else 1.0)]
    compare_with_eager(compiled, eager, inputs, params, dtype, f"{WHERE} compiled residual_rms_norm {model}")


# ------------------------------------------------------------------------------------------------ native and CPU


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_native_matches_eager(model, dtype):
    from kernels_triton import _native

    _, offset, casting = MODELS[model]
    torch.manual_seed(0)
    x, residual = torch.randn(3, 7, 97) * 2, torch.randn(3, 7, 97) * 3
    w = torch.randn(97) * 0.5 + (0.0 if offset else 1.0)
    cast = [t.to(dtype) for t in (x, residual, w)]
    ours = _native.residual_rms_norm(*cast, eps=1e-6, offset=offset, casting=casting)
    eager = _eager(model)(*cast)
    truth = _eager(model)(*(t.double() for t in (x, residual, w)))
    assert torch.equal(ours[1], eager[1])
    assert_as_good_as_eager(ours[0], eager[0], truth[0], dtype, f"native {model}")


def test_adapter_takes_the_native_path_on_cpu_and_for_promoting_dtypes():
    from kernels_triton import _residual_rms_norm

    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.randn(32)  # float32 weight: the Llama module promotes its output to float32
    normed, new_residual = _residual_rms_norm.residual_rms_norm(x, x, w, eps=1e-6, offset=0.0, casting="llama")
    expected = _eager("llama")(x, x, w)
    assert normed.dtype == torch.float32 == expected[0].dtype
    assert torch.equal(normed, expected[0]) and torch.equal(new_residual, expected[1])
    # A float32 residual with a bfloat16 attention output promotes the sum in eager: native path, same result.
    residual = torch.randn(4, 32)
    normed, new_residual = _residual_rms_norm.residual_rms_norm(x, residual, w, eps=1e-6, offset=0.0, casting="llama")
    assert new_residual.dtype == torch.float32 and torch.equal(new_residual, residual + x)
    assert not _residual_rms_norm.residual_rms_norm_supported(x.cuda() if ON_GPU else x, residual, w, casting="llama")


@requires_cuda
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_adapter_records_the_custom_op_when_traced_for_training(training):
    # Traced for training the kernel is an opaque custom op (it saves less than Inductor's decomposition); traced
    # for inference (no input needs a gradient) Inductor gets the native math to fuse with its neighbours.
    from kernels_triton import _residual_rms_norm

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, r, w):
        normed, new_residual = _residual_rms_norm.residual_rms_norm(x, r, w, eps=1e-6, offset=0.0, casting="llama")
        return normed + new_residual

    torch._dynamo.reset()
    args = [torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda"), torch.ones(64, device="cuda")]
    if training:
        args = [a.requires_grad_() for a in args]
    torch.compile(block, fullgraph=True, backend=recording_backend)(*args)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    recorded = any("kernels_triton.add_rms_norm" in target for target in targets)
    assert recorded == training, sorted(targets)
