"""kernelize checks a kernel's output against the module it replaces where the matcher probed it anyway."""

from __future__ import annotations

import broken_plugins
import kernels_core
import pytest
import torch
from kernels_core import KernelFallbackWarning
from kernels_core import Match
from kernels_core import Mode
from kernels_core._forward import forward_object
from kernels_core._kinds._context import MatchContext
from kernels_core._kinds._norms import adapt_rms_norm
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import reference
from kernels_core.testing import tiny_causal_lm


def _pm(plugin, name):
    pm = fresh_plugin_manager()
    pm.register(plugin, name, distribution=f"{name}-dist", version="0.1")
    return pm


def test_kernels_with_the_wrong_output_are_declined_at_kernelize_one_warning_each():
    pm = _pm(broken_plugins.WrongRmsNorm(), "wrong")
    model = tiny_causal_lm("llama", attention_dropout=0.5)
    eager = tiny_causal_lm("llama", attention_dropout=0.5).eval()
    rng = torch.get_rng_state()
    with pytest.warns(KernelFallbackWarning) as record:
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    # Running the kernels on the probe's inputs leaves the caller's random stream alone.
    assert torch.equal(rng, torch.get_rng_state())
    messages = sorted(str(r.message) for r in record)
    # Three RMSNorm modules (input_layernorm x 2, model.norm), three broken kernels: one warning per kernel.
    assert len(messages) == 3, messages
    double, raising, wide = messages
    for kernel, message, cause in (
            ("wide", wide, "the output has shape (2, 3, 49), where the module's own forward gives (2, 3, 48)"),
            ("double", double, "the output has dtype torch.float64, where the module's own forward gives "
                               "torch.float32"),
            ("raising", raising, "it raised ValueError: rms_norm kernel exploded on inputs the module's own forward "
                                 "takes")):
        for part in (f"kernel 'wrong.rms_norm.{kernel}' of plugin 'wrong' (wrong-dist 0.1)", "and 2 other module(s)",
                     cause, f"kernels-core check wrong --kernel wrong.rms_norm.{kernel}",
                     f'kernels.disable = ["wrong.rms_norm.{kernel}"]'):
            assert part in message, (part, message)
    rows = [e for e in kernels_core.get_report(model).entries if e.kind == "rms_norm" and not e.covered]
    assert len(rows) == 3 and all(e.kernel == "any.rms_norm.recompute" for e in rows)
    assert all("wrong.rms_norm.wide: output check failed: on the probe's inputs the output has shape (2, 3, 49)"
               in e.note for e in rows)
    ids = torch.randint(3, 100, (2, 7))
    model.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, eager(input_ids=ids).logits)
    broken_plugins.assert_strict_refuses(tiny_causal_lm("llama"), mode=Mode.TRAINING, plugin_manager=pm,
                                         match=r"strict kernelize: 3 piece\(s\) of broken plugin code: kernel "
                                               r"'wrong.rms_norm.wide' of plugin 'wrong'")


def test_a_global_kernel_with_the_wrong_output_is_declined_and_its_modules_keep_their_forward():
    pm = _pm(broken_plugins.WrongRotary(), "wrong")
    with pytest.warns(KernelFallbackWarning) as record:
        model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=pm)
    assert len(record) == 1
    assert ("kernel 'wrong.rotary.swapped' of plugin 'wrong' (wrong-dist 0.1) is not used for module "
            "'model.layers.0.self_attn' (LlamaAttention) and 1 other module(s)") in str(record[0].message)
    rows = [e for e in kernels_core.get_report(model).entries if e.kind == "rotary_embedding"]
    assert len(rows) == 2 and all(e.kernel is None for e in rows)
    assert all("wrong.rotary.swapped: output check failed: on the probe's inputs the output 0 has shape "
               "(1, 1, 5, 12), where the module's own forward gives (1, 2, 5, 12)" in e.reason for e in rows)
    # Other kinds may reroute the attention's forward (packed_attention); none of its kernels is the rejected one.
    for i in (0, 1):
        bound = forward_object(model.model.layers[i].self_attn.__dict__.get("forward"))
        assert bound is None or "wrong.rotary.swapped" not in bound.kernel_ids


def test_only_kernels_that_run_cheaply_and_safely_at_kernelize_are_checked_off_the_cpu():
    from kernels_core._kinds._context import Probe
    from kernels_core._trial import output_problem

    # The meta device stands in for an accelerator: plain PyTorch runs there, no kernel launches anything.
    for device in ("cpu", "meta"):
        norm = torch.nn.RMSNorm(8, eps=1e-6, device=device)
        x = torch.randn(2, 3, 8, device=device)
        probe = Probe((x,), {}, norm(x))
        match = Match("rms_norm", "standard", {"eps": 1e-6, "offset": 0.0, "casting": "llama"})
        ctx = MatchContext(norm)
        wide = adapt_rms_norm(norm, match, broken_plugins.rms_norm_wide, {})
        right = adapt_rms_norm(norm, match, reference.rms_norm, {})
        mismatch = ("on the probe's inputs the output has shape (2, 3, 9), where the module's own forward gives "
                    "(2, 3, 8)")
        # A portable kernel (plain PyTorch) is run wherever the module is.
        assert output_problem(norm, wide, probe, ctx, portable=True) == mismatch
        assert output_problem(norm, right, probe, ctx, portable=True) is None
        # A backend kernel only on the CPU: elsewhere its first run may compile it, so it is left to check.
        expected = mismatch if device == "cpu" else None
        assert output_problem(norm, wide, probe, ctx, portable=False) == expected
