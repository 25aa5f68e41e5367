"""A kernelized gated MLP keeps gate and up for backward, not ``act(gate) * up``, and computes eager's gradients.

``down_proj``'s weight gradient needs the product; saved-tensor hooks around its call keep only the geometry of
what it saves of the product, and its backward gets it back from the same kernel run on the kept gate and up. These
tests check what is kept (by the tensors autograd packs in the forward), that forward and gradients equal the plain
path's bit for bit, that a kernel writing its gradients into the saved gate and up (as kernels-triton's and
Liger-Kernel's do) still gives eager's gradients (and a second backward raises instead of reading them), and that
whatever ``down_proj`` is (hooked, a subclass as a LoRA layer is, frozen, under autocast, inside activation
checkpointing) the gradients stay eager's.
"""

from __future__ import annotations

import weakref

import kernels_core
import pytest
import torch
import torch.nn.functional as F
from kernels_core import Match
from kernels_core import Mode
from kernels_core._kinds import _mlp
from torch import nn


HIDDEN, INTERMEDIATE = 16, 40


class SplitMLP(nn.Module):
    def __init__(self, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=bias)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=bias)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FusedMLP(nn.Module):
    """Phi-3's layout: one ``gate_up_proj``, whose output's halves are gate and up."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation_fn(gate) * up)


def _kernelized(module: nn.Module, pm, *, recompute: bool = True) -> nn.Module:
    config = None if recompute else {"kinds": {"silu_gated_mlp": {"options": {"recompute_product": False}}}}
    kernels_core.kernelize(module, mode=Mode.TRAINING, plugin_manager=pm, config=config)
    (entry,) = [e for e in kernels_core.get_report(module).entries if e.kind == "silu_gated_mlp"]
    assert entry.kernel == "ref.silu_gated_mlp", entry.reason
    return module


def _eager_and_kernelized(pm, *, seed: int, bias: bool = False) -> tuple[nn.Module, nn.Module]:
    """A SplitMLP and a kernelized copy of it (same weights)."""
    torch.manual_seed(seed)
    eager = SplitMLP(bias=bias)
    kernelized = SplitMLP(bias=bias)
    kernelized.load_state_dict(eager.state_dict())
    return eager, _kernelized(kernelized, pm)


def _pair(factory, pm, dtype=torch.float32) -> tuple[nn.Module, nn.Module]:
    """The same weights kernelized twice: recomputing the product, and keeping it (the plain path)."""
    torch.manual_seed(0)
    recomputing = factory().to(dtype)
    keeping = factory().to(dtype)
    keeping.load_state_dict(recomputing.state_dict())
    return _kernelized(recomputing, pm), _kernelized(keeping, pm, recompute=False)


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output, then the gradients of x and of every parameter; and the saved tensors of intermediate width."""
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return out.detach(), [x.grad] + [p.grad for p in module.parameters()]


def _product_kept(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether anything keeps ``act(gate) * up``, the input of down_proj, alive once the forward returned (autograd's
    saved tensors are the only holder left). A weak reference tells: saved-tensor hooks would not, since hooks of
    the test's own would be the outer ones the adapter steps aside for."""
    seen = []
    handle = module.down_proj.register_forward_pre_hook(lambda mod, args: seen.append(weakref.ref(args[0])))
    out = module(x.clone().requires_grad_())
    handle.remove()
    (product,) = seen
    kept = product() is not None
    del out
    return kept


@pytest.mark.parametrize("factory", [SplitMLP, lambda: SplitMLP(bias=True), FusedMLP],
                         ids=["split", "split-bias", "fused"])
def test_the_product_is_recomputed_not_kept(factory, ref_pm):
    recomputing, keeping = _pair(factory, ref_pm)
    x = torch.randn(3, 7, HIDDEN)
    assert not _product_kept(recomputing, x)
    assert _product_kept(keeping, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factory", [SplitMLP, lambda: SplitMLP(bias=True), FusedMLP],
                         ids=["split", "split-bias", "fused"])
def test_forward_and_gradients_equal_the_plain_path_bit_for_bit(factory, dtype, ref_pm):
    """The recomputation runs the operations the plain path runs on the same values: no tolerance."""
    recomputing, keeping = _pair(factory, ref_pm, dtype)
    x = torch.randn(3, 7, HIDDEN, dtype=dtype)
    grad = torch.randn(3, 7, HIDDEN, dtype=dtype)
    out_r, grads_r = _run(recomputing, x, grad)
    out_k, grads_k = _run(keeping, x, grad)
    assert torch.equal(out_r, out_k)
    assert len(grads_r) == len(grads_k)
    for got, expected in zip(grads_r, grads_k, strict=True):
        assert torch.equal(got, expected)


def test_gradients_match_the_modules_own_forward(ref_pm):
    """Against the module's own forward in float32 (the widest dtype the kernels claim): the recomputed gradients
    are the math, not only consistent with the plain path. The activation rounds alike in both: 1e-5 leaves room
    for the order of a sum only."""
    eager, kernelized = _eager_and_kernelized(ref_pm, seed=1, bias=True)
    x, grad = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
    out_e, grads_e = _run(eager, x, grad)
    out_k, grads_k = _run(kernelized, x, grad)
    torch.testing.assert_close(out_k, out_e, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads_k, grads_e, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class _WritesIntoInputs(torch.autograd.Function):
    """``silu(gate) * up`` whose backward writes the gradients into the saved gate and up, as kernels-triton's and
    Liger-Kernel's kernels do for intermediate tensors."""

    @staticmethod
    def forward(ctx, gate, up):  # noqa: ANN001, ANN205
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        dgate = dout * up * sig * (1 + gate * (1 - sig))
        dup = dout * gate * sig
        gate.copy_(dgate)
        up.copy_(dup)
        torch.autograd.graph.increment_version((gate, up))
        return gate, up


def _adapted(module: SplitMLP, impl) -> nn.Module:  # noqa: ANN001
    """``module`` with the adapter's forward over ``impl``, as kernelize would bind it."""
    forward = _mlp.adapt_gated_mlp(module, Match("silu_gated_mlp", "split", {"layout": "split"}), impl, {})
    module.forward = forward
    return module


def test_a_kernel_that_reuses_its_inputs_storage_still_gives_eager_gradients():
    torch.manual_seed(2)
    eager = SplitMLP()
    kernelized = SplitMLP()
    kernelized.load_state_dict(eager.state_dict())
    _adapted(kernelized, _WritesIntoInputs.apply)
    x, grad = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    assert not _product_kept(kernelized, x)
    out_e, grads_e = _run(eager, x, grad)
    out_k, grads_k = _run(kernelized, x, grad)
    torch.testing.assert_close(out_k, out_e, rtol=1e-6, atol=1e-6)
    for got, expected in zip(grads_k, grads_e, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_a_second_backward_after_the_kernel_reused_gate_and_up_raises():
    """The product cannot be recomputed from gradients: the hooks see the kernel's version bump and raise, as
    autograd does for any saved tensor modified in place."""
    module = _adapted(SplitMLP(), _WritesIntoInputs.apply)
    out = module(torch.randn(4, HIDDEN, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()


class HookedLinear(nn.Linear):
    """A subclass, as PEFT's and bitsandbytes' layers are, doing more than F.linear with what it is given."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def _hooked(module: nn.Module) -> nn.Module:
    # ZeRO-3 gathers a layer's weight in a forward pre-hook of that layer: down_proj is still called as a module.
    module.down_proj.register_forward_pre_hook(lambda mod, args: None)
    return module


def _subclassed(module: nn.Module) -> nn.Module:
    down = HookedLinear(INTERMEDIATE, HIDDEN, bias=False)
    down.load_state_dict(module.down_proj.state_dict())
    module.down_proj = down
    return module


def _frozen(module: nn.Module) -> nn.Module:
    # LoRA elsewhere: a frozen down_proj's backward never needs the product, which eager then does not keep.
    module.down_proj.weight.requires_grad_(False)
    return module


@pytest.mark.parametrize("change", [_hooked, _subclassed, _frozen], ids=["forward-hook", "subclass", "frozen"])
def test_whatever_down_proj_is_the_gradients_are_eager(change, ref_pm):
    torch.manual_seed(3)
    eager = change(SplitMLP())
    kernelized = SplitMLP()
    kernelized.load_state_dict(eager.state_dict())
    kernelized = _kernelized(change(kernelized), ref_pm)
    x = torch.randn(2, 3, HIDDEN)
    # Gate and up, and never the product: a frozen down_proj keeps it nowhere.
    assert not _product_kept(kernelized, x)
    out_e, grads_e = _run(eager, x, torch.ones(2, 3, HIDDEN))
    out_k, grads_k = _run(kernelized, x, torch.ones(2, 3, HIDDEN))
    torch.testing.assert_close(out_k, out_e, rtol=1e-6, atol=1e-6)
    for got, expected in zip(grads_k, grads_e, strict=True):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_under_autocast_the_cast_copy_is_kept_and_the_gradients_are_eager(ref_pm):
    """Autocast casts the float32 product to bf16 for the matrix product: that copy is what down_proj saves, and it
    is kept as usual."""
    eager, kernelized = _eager_and_kernelized(ref_pm, seed=4)
    x = torch.randn(2, 3, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_e, grads_e = _run(eager, x, torch.ones(2, 3, HIDDEN))
        out_k, grads_k = _run(kernelized, x, torch.ones(2, 3, HIDDEN))
    assert out_k.dtype == out_e.dtype == torch.bfloat16
    # The same operations in bf16 on both sides, the activation computed by the reference kernel: one bf16
    # rounding apart at most.
    torch.testing.assert_close(out_k, out_e, rtol=2e-2, atol=2e-2)
    for got, expected in zip(grads_k, grads_e, strict=True):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_inside_activation_checkpointing_nothing_is_pushed_over_its_hooks(ref_pm):
    """Non-reentrant checkpointing keeps nothing of the region and recomputes it; hooks of ours pushed over its own
    would hide down_proj's tensors from it. The call then takes the plain path, and the gradients are eager's."""
    from torch.utils.checkpoint import checkpoint

    eager, kernelized = _eager_and_kernelized(ref_pm, seed=5)
    x = torch.randn(2, 3, HIDDEN)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        kernelized(x.clone().requires_grad_())
    # Under outer hooks every tensor down_proj saves reaches them, the product among them.
    assert sum(t.shape == (2, 3, INTERMEDIATE) for t in kept) >= 3
    grads = []
    for module in (eager, kernelized):
        x_ = x.clone().requires_grad_()
        checkpoint(module, x_, use_reentrant=False).sum().backward()
        grads.append([x_.grad] + [p.grad for p in module.parameters()])
    for got, expected in zip(*grads[::-1], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_an_unknown_option_of_the_kind_still_raises(ref_pm):
    with pytest.raises(kernels_core.ConfigError, match="recompute"):
        kernels_core.kernelize(SplitMLP(), mode=Mode.TRAINING, plugin_manager=ref_pm,
                               config={"kinds": {"silu_gated_mlp": {"options": {"recompute": False}}}})
