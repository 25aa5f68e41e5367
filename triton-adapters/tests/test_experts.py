"""The grouped-product MoE experts against transformers' eager experts module, forward and backward.

Each check compares with the eager module run in float64 (the truth) and in the tested dtype: the kernel may be at
most twice as far from the truth as eager in that dtype, plus a floor of a few roundoff units (conftest). Token
counts are odd and routings leave some experts with no token. On CPU the same code runs through torch's CPU
grouped products; the CUDA cases run where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES
from conftest import assert_as_good_as_eager
from conftest import requires_cuda
from kernels_triton import _experts


DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _experts_module(activation: str, n_experts: int = 8, hidden: int = 48, inter: int = 40):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[activation]
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=n_experts,
                            num_experts_per_tok=2, hidden_act=act)
    config._experts_implementation = "eager"  # transformers' loop over experts: the reference
    module = Qwen3MoeExperts(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) * hidden**-0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) * inter**-0.5)
    return module


def _routing(tokens: int, top_k: int, n_experts: int, used: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing over the first ``used`` experts only (the others get no token), softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, used, generator=gen)
    weights, index = torch.topk(scores.softmax(-1), top_k, dim=-1)
    return index, weights


def _run(fn, x, index, weights, gate_up, down, grad):
    out = fn(x, index, weights, gate_up, down)
    grads = torch.autograd.grad(out, (x, weights, gate_up, down), grad)
    return (out, *grads)


def test_routing_offsets_and_permutation():
    index = torch.tensor([[3, 1], [1, 0], [3, 3], [0, 1], [1, 3]])
    perm, inverse, rows, ends = _experts.routing(index, num_experts=5)
    flat = index.reshape(-1)
    assert torch.equal(flat[perm], torch.sort(flat, stable=True).values)
    assert torch.equal(perm[inverse], torch.arange(flat.numel()))
    assert torch.equal(rows, perm // 2)
    assert ends.dtype == torch.int32
    # Experts 2 and 4 are empty: their groups have zero length.
    assert ends.tolist() == [2, 6, 6, 10, 10]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_matches_eager_experts(device, dtype, activation, tokens):
    if device == "cpu" and dtype == torch.float16 and activation == "gelu_tanh":
        pytest.skip("float16 tanh-GELU has no CPU kernel in some torch builds; covered on CUDA")
    module = _experts_module(activation).to(device)
    index, weights = _routing(tokens, 2, module.num_experts, used=5, seed=tokens)
    index = index.to(device)
    gen = torch.Generator().manual_seed(1)
    x64 = torch.randn(tokens, module.hidden_dim, generator=gen, dtype=torch.float64)
    grad64 = torch.randn(tokens, module.hidden_dim, generator=gen, dtype=torch.float64)

    def inputs(dt):
        return (x64.to(device, dt).requires_grad_(), weights.to(device, dt).requires_grad_(),
                module.gate_up_proj.detach().to(dt).requires_grad_(),
                module.down_proj.detach().to(dt).requires_grad_())

    def eager_with_grads(dt):
        x, w, gate_up, down = inputs(dt)
        saved = module.gate_up_proj, module.down_proj
        module.gate_up_proj, module.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
        try:
            out = module(x, index, w)
            grads = torch.autograd.grad(out, (x, w, module.gate_up_proj, module.down_proj), grad64.to(device, dt))
            return (out, *grads)
        finally:
            module.gate_up_proj, module.down_proj = saved

    truth = eager_with_grads(torch.float64)
    reference = eager_with_grads(dtype)
    kernel = {"silu": _experts.moe_experts_silu, "gelu_tanh": _experts.moe_experts_gelu_tanh}[activation]
    x, w, gate_up, down = inputs(dtype)
    ours = _run(kernel, x, index, w, gate_up, down, grad64.to(device, dtype))
    for name, o, r, t in zip(("output", "d_hidden", "d_weights", "d_gate_up", "d_down"), ours, reference, truth,
                             strict=True):
        assert_as_good_as_eager(o, r, t, dtype, f"{activation} {name}")
    # Experts 5..7 got no token: their weight gradients are exactly zero, not left unwritten.
    assert ours[3][5:].abs().max().item() == 0 and ours[4][5:].abs().max().item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fullgraph_compile_forward_and_backward(device, dtype):
    """One graph under ``torch.compile(fullgraph=True)`` (a graph break or a data-dependent shape raises), same
    results as the eager path, for bfloat16 (traced ``torch._grouped_mm``) and float32 (the custom ops)."""
    torch._dynamo.reset()
    module = _experts_module("silu").to(device)
    index, weights = _routing(29, 2, module.num_experts, used=6, seed=3)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(29, module.hidden_dim, generator=gen).to(device, dtype)
    grad = torch.randn(29, module.hidden_dim, generator=gen).to(device, dtype)

    def leaves():
        return (x.clone().requires_grad_(), weights.to(device, dtype).requires_grad_(),
                module.gate_up_proj.detach().to(dtype).requires_grad_(),
                module.down_proj.detach().to(dtype).requires_grad_())

    eager = _run(_experts.moe_experts_silu, *_split(leaves(), index.to(device)), grad)
    compiled_fn = torch.compile(_experts.moe_experts_silu, fullgraph=True, dynamic=False)
    compiled = _run(compiled_fn, *_split(leaves(), index.to(device)), grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for e, c in zip(eager, compiled, strict=True):
        assert ((e.double() - c.double()).norm() / e.double().norm()).item() < tol


def _split(leaves, index):
    x, w, gate_up, down = leaves
    return x, index, w, gate_up, down


def test_unaligned_sizes_take_the_dense_path_and_match():
    """Rows that are no multiple of 16 bytes (hidden 6, intermediate 5 in float32), which the grouped products
    refuse, still give the eager result."""
    module = _experts_module("silu", n_experts=3, hidden=6, inter=5).double()
    index, weights = _routing(9, 2, 3, used=2, seed=5)
    x = torch.randn(9, 6, dtype=torch.float64)
    expected = module(x, index, weights.double())
    out = _experts.moe_experts_silu(x.float(), index, weights, module.gate_up_proj.float(), module.down_proj.float())
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_unknown_activation_names_the_allowed_ones():
    with pytest.raises(ValueError, match="silu"):
        _experts.experts_forward(torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                                 torch.zeros(1, 6, 4), torch.zeros(1, 4, 3), activation="relu")


@requires_cuda
def test_no_host_sync_on_cuda():
    """The routing metadata and both products stay on the device: a forward and backward under
    ``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising call."""
    module = _experts_module("silu").to("cuda", torch.bfloat16)
    index, weights = _routing(33, 2, module.num_experts, used=5, seed=4)
    x = torch.randn(33, module.hidden_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = weights.to("cuda", torch.bfloat16).requires_grad_()
    index = index.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _experts.moe_experts_silu(x, index, w, module.gate_up_proj, module.down_proj)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()
