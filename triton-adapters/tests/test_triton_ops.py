"""kernels-triton's Triton kernels as ``torch.library`` custom ops (``rms_norm_op``, ``rotary_op``, ``gated_op``), the
path taken under ``torch.compile``.

``torch.library.opcheck`` checks each op's schema, fake implementation (against the real outputs' shapes, dtypes and
strides), autograd registration and tracing with dynamic shapes. Then each op runs inside a
``torch.compile(fullgraph=True)`` function, forward and backward, against the eager transformers math with the
tolerances of ``conftest.assert_as_good_as_eager``. On a GPU the compiled functions use Inductor; without one the
kernels run in Triton's interpreter on CPU tensors (ids say ``interpreter``) and the graphs are compiled with the
``aot_eager`` backend (Dynamo and AOTAutograd as under Inductor, without generating C++ for the CPU).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES
from conftest import compare_with_eager
from conftest import eager_rotary
from conftest import requires_cuda


ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
WHERE = "cuda" if ON_GPU else "interpreter"
BACKEND = "inductor" if ON_GPU else "aot_eager"


@pytest.fixture(scope="module")
def ops(triton_kernels):
    from types import SimpleNamespace

    from kernels_triton import _gated
    from kernels_triton import _residual_rms_norm
    from kernels_triton import _rms_norm
    from kernels_triton import _rotary

    return SimpleNamespace(rms_norm=_rms_norm.rms_norm_op, residual_rms_norm=_residual_rms_norm.residual_rms_norm_op,
                           rotary=_rotary.rotary_op, gated_activation=_gated.gated_op)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=BACKEND)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(ops, dtype):
    x = torch.randn(6, 40, device=DEV, dtype=dtype, requires_grad=True)
    w = torch.randn(40, device=DEV, dtype=dtype, requires_grad=True)
    for offset, gemma in ((0.0, False), (1.0, True)):
        torch.library.opcheck(torch.ops.kernels_triton.rms_norm, (x, w, 1e-6, offset, gemma))
    # The backward ops are not differentiable again (no double backward): checked without requires_grad.
    x_, w_ = x.detach(), w.detach()
    _, rstd = torch.ops.kernels_triton.rms_norm(x_, w_, 1e-6, 1.0, True)
    torch.library.opcheck(torch.ops.kernels_triton.rms_norm_backward, (torch.randn_like(x_), x_, w_, rstd, 1.0, True))

    q = torch.randn(2, 3, 5, 16, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 5, 1, 16, device=DEV, dtype=dtype, requires_grad=True).transpose(1, 2)
    cos, sin = torch.randn(2, 1, 5, 12, device=DEV, dtype=dtype).unbind(0)
    for backward in (False, True):
        torch.library.opcheck(torch.ops.kernels_triton.rotary, (q, k, cos, sin, backward))

    gate = torch.randn(5, 33, device=DEV, dtype=dtype, requires_grad=True)
    up = torch.randn(5, 33, device=DEV, dtype=dtype, requires_grad=True)
    for gelu in (False, True):
        torch.library.opcheck(torch.ops.kernels_triton.gated, (gate, up, gelu))
        torch.library.opcheck(torch.ops.kernels_triton.gated_backward,
                              (torch.randn_like(gate), gate.detach(), up.detach(), gelu))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_compiled_rms_norm_matches_eager(ops, model, dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cls, offset = (LlamaRMSNorm, 0.0) if model == "llama" else (GemmaRMSNorm, 1.0)

    def eager(x, w):
        m = cls(x.shape[-1], eps=1e-6).to(device=x.device, dtype=x.dtype)
        del m.weight
        m.weight = w
        return m(x) * 2 + 1

    ours = _compiled(lambda x, w: ops.rms_norm(x, w, eps=1e-6, offset=offset, gemma=model == "gemma") * 2 + 1)
    x = torch.randn(3, 37, 100, device=DEV) * 2 + 0.3
    w = torch.randn(100, device=DEV) * 0.5 + (0.0 if offset else 1.0)
    compare_with_eager(ours, eager, [x], [w], dtype, f"{WHERE} compiled {model} rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary", [64, 48], ids=["full", "partial"])
def test_compiled_rotary_matches_eager(ops, rotary, dtype):
    angles = torch.randn(1, 33, rotary, device=DEV)

    def eager(q, k):
        q_out, k_out = eager_rotary(q, k, angles.cos().to(q.dtype), angles.sin().to(q.dtype))
        return q_out * 3, k_out - 1

    def fn(q, k):
        q_out, k_out = ops.rotary(q, k, angles.cos().to(q.dtype), angles.sin().to(q.dtype))
        return q_out * 3, k_out - 1

    # The projection layout [B, S, H, D] viewed as [B, H, S, D], as attentions pass it.
    q = torch.randn(2, 33, 6, 64, device=DEV).transpose(1, 2)
    k = torch.randn(2, 33, 2, 64, device=DEV).transpose(1, 2)
    compare_with_eager(_compiled(fn), eager, [q, k], [], dtype, f"{WHERE} compiled rope {rotary}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_compiled_gated_matches_eager(ops, gelu, dtype):
    import torch.nn.functional as F

    def eager(gate, up):
        act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
        return (act * up) @ proj.to(gate.dtype)

    proj = torch.randn(50, 7, device=DEV)
    ours = _compiled(lambda gate, up: ops.gated_activation(gate, up, gelu=gelu) @ proj.to(gate.dtype))
    gate, up = torch.randn(2, 2, 9, 50, device=DEV).unbind(0)
    compare_with_eager(ours, eager, [gate, up], [], dtype, f"{WHERE} compiled gated gelu={gelu}")


@requires_cuda
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_adapters_record_the_custom_ops_when_traced(training):
    # Through the adapters (which take the native path on CPU), a training trace must record one opaque node per
    # kernel, not the native math and not a graph break; an inference trace (nothing needs a gradient) records
    # the native math instead, for Inductor to fuse.
    from kernels_triton import _gated
    from kernels_triton import _rms_norm
    from kernels_triton import _rotary

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, w, gate, up, q, k, cos, sin):
        q, k = _rotary.rotary_embedding(q, k, cos, sin)
        hidden = _rms_norm.rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama")
        return hidden, _gated.silu_mul(gate, up), q, k

    torch._dynamo.reset()
    args = (torch.randn(8, 64, device="cuda"), torch.ones(64, device="cuda"), torch.randn(8, 32, device="cuda"),
            torch.randn(8, 32, device="cuda"), torch.randn(1, 4, 8, 16, device="cuda"),
            torch.randn(1, 2, 8, 16, device="cuda"), torch.randn(1, 8, 16, device="cuda"),
            torch.randn(1, 8, 16, device="cuda"))
    if training:
        args = tuple(a.requires_grad_() if i not in (1, 6, 7) else a for i, a in enumerate(args))
    torch.compile(block, fullgraph=True, backend=recording_backend)(*args)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    for op in ("kernels_triton.rms_norm", "kernels_triton.rotary", "kernels_triton.gated"):
        recorded = any(op in target for target in targets)
        assert recorded == training, f"{op} {'not ' if training else ''}in the traced graph: {sorted(targets)}"
