"""Liger adapters against the eager transformers modules on an NVIDIA GPU: forward and backward, three dtypes.

Each check compares our output and gradients, and eager's in the same dtype, with a float64 run of the eager
module (the truth); see ``conftest.assert_as_good_as_eager`` for the tolerance rule and its per-dtype floors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES
from conftest import FLOOR
from conftest import assert_as_good_as_eager
from conftest import assert_upstream_gradient_untouched
from conftest import compare_with_eager
from conftest import eager_rotary
from conftest import rel_err
from conftest import requires_cuda
from conftest import run_with_grads
from kernels_triton import _gated
from kernels_triton import _layer_norm
from kernels_triton import _loss
from kernels_triton import _moe
from kernels_triton import _rms_norm
from kernels_triton import _rotary


pytestmark = requires_cuda
DEV = "cuda"


def _compare(fn_ours, fn_eager, inputs, params, dtype, what, *, floor=None):
    compare_with_eager(fn_ours, fn_eager, [t.to(DEV) for t in inputs], [t.to(DEV) for t in params], dtype, what,
                       floor=floor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 37, 1000), (2, 5, 4096), (40000, 128)], ids=str)
@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_rms_norm(model, shape, dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = shape[-1]
    cls, offset, casting = (LlamaRMSNorm, 0.0, "llama") if model == "llama" else (GemmaRMSNorm, 1.0, "gemma")

    def eager(x, w):
        m = cls(hidden, eps=1e-6).to(device=DEV, dtype=x.dtype)
        del m.weight
        m.weight = w  # the very tensor, so its gradient is ours to compare
        return m(x)

    def ours(x, w):
        return _rms_norm.liger_rms_norm(x, w, eps=1e-6, offset=offset, casting=casting)

    x = torch.randn(shape, device=DEV)
    w = torch.randn(hidden, device=DEV) * 0.5 + (0.0 if offset else 1.0)
    _compare(ours, eager, [x], [w], dtype, f"{model} rms_norm {shape}")


def test_rms_norm_does_not_touch_upstream_gradient():
    assert_upstream_gradient_untouched(_rms_norm.liger_rms_norm, DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_mlp(act, dtype):
    from transformers import GemmaConfig
    from transformers import LlamaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    if act == "silu":
        mlp = LlamaMLP(LlamaConfig(hidden_size=200, intermediate_size=333, num_attention_heads=4)).to(DEV)
        fn = _gated.liger_silu_mul
    else:
        mlp = GemmaMLP(GemmaConfig(hidden_size=200, intermediate_size=333, num_attention_heads=4, head_dim=50,
                                   hidden_activation="gelu_pytorch_tanh"))
        mlp = mlp.to(DEV)
        fn = _gated.liger_gelu_tanh_mul
    w = [mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()]

    def eager(x, wg, wu, wd):
        return F.linear(mlp.act_fn(F.linear(x, wg)) * F.linear(x, wu), wd)

    def ours(x, wg, wu, wd):
        return F.linear(fn(F.linear(x, wg), F.linear(x, wu)), wd)

    x = torch.randn(3, 41, 200, device=DEV)
    with torch.no_grad():  # the modules' own forward agrees with the closure used for gradients
        torch.testing.assert_close(eager(x, *w), mlp(x))
    _compare(ours, eager, [x], w, dtype, f"{act} mlp")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary", [64, 32], ids=["full", "partial"])
def test_rope(rotary, dtype):
    theta = torch.randn(1, 33, rotary // 2, device=DEV).repeat(1, 1, 2)

    # cos/sin are buffers in every model (no gradient); they follow q's dtype as the rotary modules return them.
    def eager(q, k):
        return eager_rotary(q, k, theta.cos().to(q.dtype), theta.sin().to(q.dtype))

    def ours(q, k):
        return _rotary.liger_rotary_embedding(q, k, theta.cos().to(q.dtype), theta.sin().to(q.dtype))

    # the projection layout [B, S, H, D] viewed as [B, H, S, D], as attention modules pass it
    q = torch.randn(2, 33, 6, 64, device=DEV).transpose(1, 2)
    k = torch.randn(2, 33, 2, 64, device=DEV).transpose(1, 2)
    q_keep = q.to(dtype).clone()
    _compare(ours, eager, [q, k], [], dtype, f"rope {rotary}")
    q_in = q.to(dtype)
    ours(q_in, k.to(dtype))
    assert torch.equal(q_in, q_keep), "the adapter modified its input"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm(dtype):
    def eager(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)

    def ours(x, w, b):
        return _layer_norm.layer_norm(x, w, b, eps=1e-5)

    x = torch.randn(5, 19, 999, device=DEV)
    _compare(ours, eager, [x], [torch.randn(999, device=DEV), torch.randn(999, device=DEV)], dtype, "layer_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["mean", "num_items", "softcap"])
def test_fused_linear_cross_entropy(case, dtype):
    n, h, v = 1037, 96, 5003
    labels = torch.randint(0, v, (n,), device=DEV)
    labels[::7] = -100
    num_items = 901 if case == "num_items" else None
    softcap = 30.0 if case == "softcap" else None

    def eager(x, w):
        logits = (x @ w.T).float()
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum" if num_items else "mean")
        return loss / num_items if num_items else loss

    def ours(x, w):
        return _loss.fused_linear_cross_entropy(x, w, labels, bias=None, ignore_index=-100,
                                                num_items_in_batch=num_items, softcap=softcap)

    x, w = torch.randn(n, h, device=DEV), torch.randn(v, h, device=DEV) * 0.1
    # the loss is float32 in both; its truth comes from the float64 run, so compare loss values directly
    with torch.no_grad():
        lo, le = ours(x.to(dtype), w.to(dtype)), eager(x.to(dtype), w.to(dtype))
        assert lo.dtype == torch.float32 and lo.dim() == 0
        lt = eager(x.double(), w.double())
    assert abs(lo.item() - lt.item()) <= 2 * abs(le.item() - lt.item()) + FLOOR[dtype] * abs(lt.item())
    _, g_ours = run_with_grads(ours, [x.to(dtype)], [w.to(dtype)], [torch.tensor(1.0, device=DEV)])
    _, g_eager = run_with_grads(eager, [x.to(dtype)], [w.to(dtype)], [torch.tensor(1.0, device=DEV)])
    _, g_truth = run_with_grads(eager, [x.double()], [w.double()], [torch.tensor(1.0, device=DEV)])
    for i in range(2):
        assert_as_good_as_eager(g_ours[i], g_eager[i], g_truth[i], dtype, f"flce {case} grad {i}")


def test_fused_linear_cross_entropy_compiles_fullgraph():
    torch._dynamo.reset()
    x = torch.randn(512, 64, device=DEV, requires_grad=True)
    w = torch.randn(1000, 64, device=DEV, requires_grad=True)
    labels = torch.randint(0, 1000, (512,), device=DEV)

    def loss_fn(x, w):
        return _loss.fused_linear_cross_entropy(x, w, labels, bias=None, ignore_index=-100, num_items_in_batch=None,
                                                softcap=None) * 2.0

    compiled = torch.compile(loss_fn, fullgraph=True)
    loss = compiled(x, w)
    loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = 2.0 * F.cross_entropy(x @ w.T, labels)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
    # a 2.0 upstream gradient checks the autograd formula's scaling; tf32 matmuls allow ~1e-3
    assert rel_err(gx, x.grad) < 2e-3 and rel_err(gw, w.grad) < 2e-3


@pytest.mark.parametrize("fn,args", [
    (lambda x, w: _rms_norm.liger_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama"), "norm"),
    (lambda a, b: _gated.liger_silu_mul(a, b), "pair"),
    (lambda a, b: _gated.liger_gelu_tanh_mul(a, b), "pair"),
], ids=["rms_norm", "silu", "gelu"])
def test_adapters_trace_fullgraph(fn, args):
    torch._dynamo.reset()
    a = torch.randn(64, 128, device=DEV, requires_grad=True)
    b = (torch.randn(128, device=DEV) if args == "norm" else torch.randn(64, 128, device=DEV)).requires_grad_(True)
    out = torch.compile(fn, fullgraph=True)(a, b)
    out.sum().backward()
    torch.testing.assert_close(out, fn(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_moe_experts(dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2)
    t = 301
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(t)]).to(DEV)
    weights = torch.rand(t, 2, device=DEV)

    def eager(x, gu, d, w):
        m = Qwen3MoeExperts(cfg).to(device=DEV, dtype=x.dtype)
        del m.gate_up_proj, m.down_proj
        m.gate_up_proj, m.down_proj = gu, d
        return m(x, idx, w)

    def ours(x, gu, d, w):
        return _moe.moe_experts_silu(x, idx, w, gu, d)

    x = torch.randn(t, 256, device=DEV)
    gu, d = torch.randn(8, 192, 256, device=DEV) * 0.06, torch.randn(8, 256, 96, device=DEV) * 0.1
    if dtype == torch.float32:
        # Liger's fused MoE multiplies with tl.dot, which uses TF32 for float32 (10-bit mantissa): ~1e-3 relative
        # per product, like torch with allow_tf32. Compare against an eager run that also uses TF32.
        # The floor becomes TF32's (5e-3 relative), the eager reference stays in full float32.
        _compare(ours, eager, [x], [gu, d, weights], dtype, "moe", floor=5e-3)
        return
    _compare(ours, eager, [x], [gu, d, weights], dtype, "moe")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs to check launches on a non-current one")
@pytest.mark.parametrize("adapter", ["liger", "triton"])
def test_launches_on_the_inputs_device_not_the_current_one(adapter):
    # device_map puts layers on cuda:1 while cuda:0 stays current; Triton launches on the current device unless the
    # adapter switches. Each kind is run on cuda:1 with cuda:0 current and compared with the same call on the CPU.

    rms_norm = _rms_norm.liger_rms_norm if adapter == "liger" else _rms_norm.rms_norm
    silu_mul = _gated.liger_silu_mul if adapter == "liger" else _gated.silu_mul
    rope = _rotary.liger_rotary_embedding if adapter == "liger" else _rotary.rotary_embedding
    x, w = torch.randn(4096, 1024), torch.randn(1024)
    gate, up = torch.randn(512, 768), torch.randn(512, 768)
    q, k = torch.randn(2, 33, 6, 64).transpose(1, 2), torch.randn(2, 33, 2, 64).transpose(1, 2)
    angles = torch.randn(1, 33, 64)
    cases = {
        "rms_norm": (lambda *t: rms_norm(*t, eps=1e-6, offset=0.0, casting="llama"), (x, w)),
        "silu_mul": (silu_mul, (gate, up)),
        "rope": (rope, (q, k, angles.cos(), angles.sin())),
    }
    for name, (fn, cpu_args) in cases.items():
        expected = fn(*cpu_args)
        for _ in range(2):  # the second call launches the kernel compiled by the first
            with torch.cuda.device(0):
                ours = fn(*[t.to("cuda:1") for t in cpu_args])
            ours = ours if isinstance(ours, tuple) else (ours,)
            assert all(o.device == torch.device("cuda:1") for o in ours), name
            for o, e in zip(ours, expected if isinstance(expected, tuple) else (expected,), strict=True):
                torch.testing.assert_close(o.cpu(), e, rtol=1e-5, atol=1e-5, msg=f"{adapter} {name}")
