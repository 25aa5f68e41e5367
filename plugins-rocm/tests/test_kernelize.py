"""Resolution through ``kernels_core.kernelize`` against simulated ROCm devices, per gfx architecture and mode.

The models are tiny transformers models on the CPU; ``device=`` makes kernelize resolve them as if they ran on the
simulated AMD device. Which kernel each module gets is decided by this plugin's declarations, so that is what is
checked here; the kernels themselves run their CPU paths (the shared adapters' numerics are tested on an NVIDIA
GPU in triton-adapters/tests).
"""

from __future__ import annotations

import pytest
import torch
from kernels_core import KernelizeError
from kernels_core import Mode
from kernels_core import detect_devices
from kernels_core import get_report
from kernels_core import kernelize
from kernels_core import unkernelize
from kernels_core.testing import assert_close
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm
from kernels_rocm import _plugin as rocm_plugin
from rocm_testing import MI50
from rocm_testing import MI250X
from rocm_testing import MI300X
from rocm_testing import MI355X
from rocm_testing import RX7900


@pytest.fixture
def pm():
    return fresh_plugin_manager((rocm_plugin, "rocm"))


def _chosen(model):
    """kind -> the set of kernels applied to its modules (None where a module got none; modules an enclosing
    module's kernel covers are neither)."""
    chosen: dict[str, set[str | None]] = {}
    for entry in get_report(model).entries:
        if not entry.covered:
            chosen.setdefault(entry.kind, set()).add(entry.kernel)
    return chosen


def _reasons(model, kind):
    return {e.reason for e in get_report(model).entries if e.kind == kind and not e.applied}


def _kernelized(family, pm, *, mode=Mode.TRAINING, device="cuda", **kwargs):
    model = tiny_causal_lm(family)
    return kernelize(model, mode=mode, device=device, plugin_manager=pm, **kwargs)


@pytest.mark.parametrize("device", [MI300X, MI250X, MI355X])
def test_cdna_gets_fused_triton_kernels_and_native_norms(simulate, pm, device):
    simulate("rocm", [device])
    assert _chosen(_kernelized("llama", pm)) == {
        "rms_norm": {"rocm.rms_norm.torch"},
        "residual_rms_norm": {"rocm.residual_rms_norm.triton"},
        "silu_gated_mlp": {"rocm.silu_gated_mlp.triton"},
        "rotary_embedding": {"rocm.rotary_embedding.triton"},
        "causal_lm_loss": {"rocm.causal_lm_loss.liger"},
        # Device-independent: the compiled causal mask and packed rows' per-document attention (core portable
        # kernels; kernels-rocm leaves packed_attention out of its native family, NATIVE_EXCLUDED).
        "causal_mask": {"any.causal_mask.sdpa_is_causal"},
        "packed_attention": {"any.packed_attention.per_document"},
    }
    assert _chosen(_kernelized("qwen3_moe", pm))["moe_experts"] == {"rocm.moe_experts.liger"}


def test_gemma_offset_norms_and_gelu_mlp_on_gfx942(simulate, pm):
    simulate("rocm", [MI300X])
    model = _kernelized("gemma", pm)
    assert _chosen(model)["gelu_gated_mlp"] == {"rocm.gelu_gated_mlp.triton"}
    assert _chosen(model)["rms_norm"] == {"rocm.rms_norm.torch"}
    assert {e.variant for e in get_report(model).entries if e.kind == "rms_norm"} == {"offset"}


def test_rdna3_gets_row_wise_triton_kernels_but_no_moe_kernel(simulate, pm):
    simulate("rocm", [RX7900])
    chosen = _chosen(_kernelized("qwen3_moe", pm))
    assert chosen["causal_lm_loss"] == {"rocm.causal_lm_loss.liger"}
    assert chosen["rotary_embedding"] == {"rocm.rotary_embedding.triton"}
    # No kernel qualifies (no native or portable MoE kernel): the experts keep their eager forward, with the reason.
    assert chosen["moe_experts"] == {None}
    (reason,) = _reasons(_kernelized("qwen3_moe", pm), "moe_experts")
    assert "architecture unsupported: device is gfx1100" in reason and "gfx942" in reason


def test_unsupported_arch_falls_back_to_native_and_portable_kernels(simulate, pm):
    simulate("rocm", [MI50])  # gfx906: no Triton or Liger kernel is declared for it
    assert _chosen(_kernelized("llama", pm)) == {
        "rms_norm": {"rocm.rms_norm.torch"},
        "residual_rms_norm": {"rocm.residual_rms_norm.torch"},
        "silu_gated_mlp": {"rocm.silu_gated_mlp.torch"},
        "rotary_embedding": {"rocm.rotary_embedding.torch"},
        "causal_lm_loss": {"any.causal_lm_loss.chunked"},
        # Device-independent: the compiled causal mask and packed rows' per-document attention (core portable
        # kernels; kernels-rocm leaves packed_attention out of its native family, NATIVE_EXCLUDED).
        "causal_mask": {"any.causal_mask.sdpa_is_causal"},
        "packed_attention": {"any.packed_attention.per_document"},
    }
    (reason,) = _reasons(_kernelized("qwen3_moe", pm), "moe_experts")
    assert "architecture unsupported: device is gfx906" in reason


def test_unsupported_arch_reason_is_stated_when_liger_is_requested(simulate, pm):
    simulate("rocm", [MI50])
    config = {"kinds": {"causal_lm_loss": {"prefer": {"rocm": ["rocm.causal_lm_loss.liger"]}}}}
    with pytest.raises(KernelizeError, match=r"architecture unsupported: device is gfx906.*any\.causal_lm_loss"):
        _kernelized("llama", pm, config=config)


def test_strict_kernelize_names_the_architecture(simulate, pm):
    simulate("rocm", [RX7900])
    with pytest.raises(KernelizeError, match=r"moe_experts.*device is gfx1100"):
        _kernelized("qwen3_moe", pm, strict=True)


def test_device_without_known_arch_gets_native_kernels_only(simulate, pm):
    simulate("rocm", [("AMD Radeon Graphics", "")])
    chosen = _chosen(_kernelized("llama", pm))
    assert chosen["silu_gated_mlp"] == {"rocm.silu_gated_mlp.torch"}
    assert chosen["causal_lm_loss"] == {"any.causal_lm_loss.chunked"}


def test_torch_compile_mode_gets_compile_safe_kernels(simulate, pm):
    simulate("rocm", [MI300X])
    assert _chosen(_kernelized("llama", pm, mode=Mode.TRAINING | Mode.TORCH_COMPILE)) == {
        "rms_norm": {"rocm.rms_norm.torch"},
        "residual_rms_norm": {"rocm.residual_rms_norm.triton"},
        "silu_gated_mlp": {"rocm.silu_gated_mlp.triton"},
        "rotary_embedding": {"rocm.rotary_embedding.triton"},
        "causal_lm_loss": {"rocm.causal_lm_loss.liger"},
        # Device-independent: the compiled causal mask (core portable kernel). packed_attention declines under
        # torch.compile (it reads the documents off the mask on the host).
        "causal_mask": {"any.causal_mask.sdpa_is_causal"},
        "packed_attention": {None},
    }


def test_each_device_resolves_by_its_own_arch(simulate, pm):
    simulate("rocm", [RX7900, MI300X])
    assert _chosen(_kernelized("qwen3_moe", pm, device="cuda:0"))["moe_experts"] == {None}
    assert _chosen(_kernelized("qwen3_moe", pm, device="cuda:1"))["moe_experts"] == {"rocm.moe_experts.liger"}
    # The backend name resolves to its first device.
    assert _chosen(_kernelized("qwen3_moe", pm, device="rocm"))["moe_experts"] == {None}


def test_cpu_modules_are_never_claimed(simulate, pm):
    simulate("rocm", [MI300X])
    model = kernelize(tiny_causal_lm("llama"), mode=Mode.TRAINING, plugin_manager=pm)  # device from the model: cpu
    assert {e.backend for e in get_report(model).entries} == {"cpu"}
    assert not any((e.kernel or "").startswith("rocm.") for e in get_report(model).entries)


def test_cuda_build_leaves_rocm_unclaimed(simulate, pm):
    simulate("cuda", [("NVIDIA H100 80GB HBM3", (9, 0))])
    assert [b.backend for b in detect_devices(plugin_manager=pm)] == ["cpu"]
    with pytest.raises(KernelizeError, match="no installed plugin detected it"):
        _kernelized("llama", pm)


def test_kernelized_model_computes_the_same_logits_and_unkernelizes(simulate, pm):
    # On the CPU the bound adapters take their native paths: this checks the plumbing, not Liger's numerics.
    simulate("rocm", [MI300X])
    eager = tiny_causal_lm("llama")
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = eager(ids).logits
        model = kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, device="cuda", plugin_manager=pm)
        report = get_report(model)
        # Inference: the fused loss never runs, so only the loss kind is declined (with that reason).
        assert report.applied and {e.kind for e in report.skipped} == {"causal_lm_loss"}, report
        assert_close(model(ids).logits, expected, what="kernelized logits")
        unkernelize(model)
        assert get_report(model) is None
        assert torch.equal(model(ids).logits, expected)
