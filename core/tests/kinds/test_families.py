"""Classification and numerics on real transformers families built from tiny configs (no downloads).

The reference plugin implements every kind with the reference math, so a kernelized model must match eager to
rounding: a matcher that accepted a module whose math differs would show up as an output or gradient error.
"""

from __future__ import annotations

import re

import kernels_core
import pytest
import torch
from kernels_core import KernelSpec
from kernels_core import Mode
from kernels_core import Supports
from kernels_core.testing import FAMILIES
from kernels_core.testing import assert_close
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import reference
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")

OFFSET_NORM = {"gemma", "gemma2", "gemma3_text"}
GELU = {"gemma", "gemma2", "gemma3_text"}
MOE = {"qwen3_moe", "mixtral"}
FUSED_MLP = {"phi3"}


def _report_map(model):
    report = kernels_core.get_report(model)
    return {(e.module, e.kind): e for e in report.entries}


def _expected(family: str) -> dict[str, tuple[str, str]]:
    """Regex over module names -> (kind, variant) that must be matched and get a kernel."""
    norm = ("rms_norm", "offset" if family in OFFSET_NORM else "standard")
    expected = {
        r"model\.layers\.\d+\.input_layernorm": norm,
        r"model\.norm": norm,
        r"model\.layers\.\d+\.self_attn": ("rotary_embedding", "full"),
        r"": ("causal_lm_loss", "softcap" if family == "gemma2" else "standard"),
    }
    if family in MOE:
        expected[r"model\.layers\.\d+\.mlp\.experts"] = ("moe_experts", "silu")
    else:
        kind = "gelu_gated_mlp" if family in GELU else "silu_gated_mlp"
        expected[r"model\.layers\.\d+\.mlp"] = (kind, "fused" if family in FUSED_MLP else "split")
    return expected


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # identical dropout masks where a family trains with dropout (Seed-OSS)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_classified_by_its_math(family, ref_pm):
    model = tiny_causal_lm(family)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    entries = _report_map(model)
    for pattern, (kind, variant) in _expected(family).items():
        hits = [e for (name, k), e in entries.items() if k == kind and re.fullmatch(pattern, name)]
        assert hits, f"{family}: nothing matched {pattern!r} as {kind}; report:\n{kernels_core.get_report(model)}"
        for entry in hits:
            assert entry.variant == variant, f"{family} {entry.module}: {entry.variant} != {variant}"
            assert entry.kernel is not None, f"{family} {entry.module}: no kernel ({entry.reason})"


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


@DTYPES
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_outputs_and_gradients_match_eager(family, dtype, ref_pm, calls):
    model = tiny_causal_lm(family, dtype=dtype)
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (2, 11))
    labels = ids.clone()
    labels[0, :3] = -100
    model.eval()
    with torch.no_grad():
        eager_logits = model(input_ids=ids).logits
    model.train()
    eager_loss, eager_grads = _loss_and_grads(model, ids, labels)

    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    # MoE output sums several experts per token; in bf16 the summation order alone moves it by a few ulps more.
    assert_close(logits, eager_logits, dtype=dtype, factor=2.0 if family in MOE else 1.0, what=f"{family} logits")

    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    model.train()
    calls.clear()
    loss, grads = _loss_and_grads(model, ids, labels)
    assert_close(loss, eager_loss, dtype=dtype, what=f"{family} loss")
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        if dtype == torch.bfloat16 and family in MOE:
            # A rounding-level difference in layer 0 can flip a near-tied top-k routing choice in layer 1, which
            # moves whole tokens between experts, so per-expert and router gradients are not comparable in
            # bf16. Loss and logits are checked above; the fp32 run checks every gradient at the fp32 bound.
            break
        # Gradients pass through every layer backwards; allow twice the single-op bound.
        assert_close(grad, eager_grads[name], dtype=dtype, factor=2.0, what=f"{family} grad {name}")
    expected_kinds = {kind for kind, _ in _expected(family).values()}
    assert expected_kinds <= set(calls), f"{family}: kernels not called for {expected_kinds - set(calls)}"


def test_fused_training_path_builds_no_kv_cache_unless_asked(ref_pm):
    # A cache in a training step only holds every layer's keys and values alive through the loss (the step's peak
    # memory); eagerly transformers builds one by default (config.use_cache).
    model = tiny_causal_lm("qwen3")
    model.config.use_cache = True  # transformers' default (the test helper turns it off)
    ids = torch.randint(3, 100, (2, 11))
    model.train()
    assert model(input_ids=ids, labels=ids).past_key_values is not None, "eager default: a cache is built"
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    default = model(input_ids=ids, labels=ids)
    assert default.logits is None and default.past_key_values is None
    asked = model(input_ids=ids, labels=ids, use_cache=True)
    assert asked.past_key_values is not None and asked.past_key_values.get_seq_length() == ids.shape[1]
    assert_close(asked.loss, default.loss, dtype=torch.float32, what="loss with and without a cache")


# Families beyond the required list: each is either handled with matching math or left alone with a reason.
OTHER_FAMILIES = {
    "granite": {"causal_lm_loss": "scaled", "residual_rms_norm": "standard"},  # logits / logits_scaling; multiplier
    "cohere": {"causal_lm_loss": "scaled"},         # logits * logit_scale
    "gpt_oss": {"moe_experts": "declined"},         # transposed, biased, clamped experts
    "qwen3_next": {"rms_norm": "offset"},           # (1 + w) norms; the gated norm is declined
    "olmo2": {"rms_norm": "standard"},             # scales in float32 (Gemma casting); cos/sin stay float32
    "olmo3": {"rms_norm": "standard", "rotary_embedding": "full"},
    "starcoder2": {"layer_norm": "bias"},
    "phi": {"rotary_embedding": "full"},            # the attention slices; the function rotates all it gets
    "falcon_h1": {},
    "olmoe": {"moe_experts": "silu"},
    "qwen2_moe": {},
    "smollm3": {},
    "exaone4": {},
    "llama4_text": {},
    "ernie4_5": {},
    "glm4": {},
    "glm": {},
    "nemotron": {},
    "helium": {},
    "bitnet": {},
    "seed_oss": {"silu_gated_mlp": "declined"},     # MLP applies residual dropout in training
    "hunyuan_v1_dense": {},
    "ministral": {},
}


# Hybrid families whose default state sizes are not small: keep every test model tiny, whatever the version.
TINY_OVERRIDES = {
    # Granite's multipliers away from 1.0 (its config's defaults), so a missing one shows in the numbers.
    "granite": {"residual_multiplier": 0.22, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
                "logits_scaling": 8.0},
    "falcon_h1": {"mamba_d_ssm": 48, "mamba_n_heads": 4, "mamba_d_head": 12, "mamba_d_state": 16,
                  "mamba_chunk_size": 8},
}


@DTYPES
@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_other_families_are_handled_or_left_alone(family, dtype, ref_pm):
    # In the model's own dtype: a difference that only exists in half precision (where a norm rounds, the dtype
    # cos/sin arrive in) must be matched exactly or declined, never crash the forward.
    try:
        model = tiny_causal_lm(family, dtype=dtype, **TINY_OVERRIDES.get(family, {}))
    except Exception as exc:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"{family} cannot be built from a tiny config with this transformers: {exc}")
    torch.manual_seed(2)
    ids = torch.randint(3, 100, (2, 9))
    model.train()
    eager_loss, eager_grads = _loss_and_grads(model, ids, ids)
    model.eval()
    with torch.no_grad():
        eager_logits = model(input_ids=ids).logits
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    report = kernels_core.get_report(model)
    for kind, expectation in OTHER_FAMILIES[family].items():
        rows = [e for e in report.entries if e.kind == kind]
        assert rows, f"{family}: no {kind} row; report:\n{report}"
        if expectation == "declined":
            assert any(e.kernel is None and e.reason for e in rows), f"{family}: {kind} should be left alone"
        else:
            assert any(e.variant == expectation and e.kernel for e in rows), f"{family}: {kind} {expectation}"
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    factor = 2.0 if family in {"olmoe", "qwen2_moe", "qwen3_next", "llama4_text"} else 1.0  # expert sums, as above
    assert_close(logits, eager_logits, dtype=dtype, factor=factor, what=f"{family} logits")
    model.train()
    loss, grads = _loss_and_grads(model, ids, ids)
    assert_close(loss, eager_loss, dtype=dtype, factor=factor, what=f"{family} loss")
    if dtype != torch.float32 and family in {"olmoe", "qwen2_moe", "qwen3_next", "falcon_h1", "llama4_text"}:
        return  # routed experts: rounding can flip top-k choices (see above); loss and logits are checked
    for name, grad in grads.items():
        assert_close(grad, eager_grads[name], dtype=dtype, factor=2.0, what=f"{family} grad {name}")


@pytest.mark.parametrize(("family", "casting"), [("olmo2", "gemma"), ("gemma", "gemma"), ("qwen3", "llama")])
def test_norm_casting_found_in_float32_holds_in_bfloat16(family, casting, ref_pm):
    # Llama's and Gemma's casting orders give identical float32 numbers; kernelized in float32 and then cast
    # (what a trainer with autocast or a later model.to() does), the kernel must still round like the module.
    model = tiny_causal_lm(family)
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=ref_pm)
    # Norms a decoder-layer kernel computes itself have no binding of their own.
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and "forward" in m.__dict__]
    assert norms and all(m.forward.__self__.match.params["casting"] == casting for m in norms), \
        f"{family}: wrong casting"
    model.to(torch.bfloat16).eval()
    ids = torch.randint(3, 100, (2, 9))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        kernels_core.unkernelize(model)
        eager = model(input_ids=ids).logits
    torch.testing.assert_close(logits, eager, rtol=0, atol=0, msg=f"{family}: bf16 logits differ after casting")
    # Built in bfloat16 with freshly initialised (all-ones) weights, the casting is found just the same.
    half = kernels_core.kernelize(tiny_causal_lm(family, dtype=torch.bfloat16), mode=Mode.INFERENCE,
                                  plugin_manager=ref_pm)
    norms = [m for m in half.modules() if type(m).__name__.endswith("RMSNorm") and "forward" in m.__dict__]
    assert all(m.forward.__self__.match.params["casting"] == casting for m in norms), f"{family}: wrong bf16 casting"


# Small parameters (norm weights and biases, an activation's learnable scalars): each gradient is a sum over every
# token, so a kernel that reduced it in half precision, or that rescaled the gradient reaching it, would show here
# first. Apertus's MLP activation, xIELU, learns two scalars (alpha_p, alpha_n); Phi and StarCoder2 add LayerNorm and
# linear biases (Phi's head has one).
SMALL_PARAMETER_FAMILIES = [*sorted(FAMILIES), "apertus", "phi", "starcoder2"]
# Gradient accumulation over three micro-batches: the loss's upstream gradient is 1/3, which bfloat16 rounds.
ACCUMULATION = 1 / 3


def _small_parameter_errors(family, plugin_manager, *, batches=2):
    """{name: (eager error, kernelized error)} of every parameter with at most one dimension, in bfloat16.

    The error is ``||g - g32|| / ||g32||`` over the gradients of all ``batches`` together, against the float32 model
    with the same (bfloat16-rounded) weights: one batch alone can have a near-zero gradient (xIELU's scalars sum
    terms of both signs), whose relative error is then all noise.
    """
    try:
        reference = tiny_causal_lm(family, **TINY_OVERRIDES.get(family, {}))
    except Exception as exc:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"{family} cannot be built from a tiny config with this transformers: {exc}")
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in reference.state_dict().items()}
    reference.load_state_dict(state)  # float32 holding the bfloat16 values: only the arithmetic differs
    eager = tiny_causal_lm(family, dtype=torch.bfloat16, **TINY_OVERRIDES.get(family, {}))
    eager.load_state_dict(state)
    kernelized = tiny_causal_lm(family, dtype=torch.bfloat16, **TINY_OVERRIDES.get(family, {}))
    kernelized.load_state_dict(state)
    kernels_core.kernelize(kernelized, mode=Mode.TRAINING, plugin_manager=plugin_manager)
    grads = {which: {} for which in ("fp32", "eager", "kernelized")}
    for batch in range(batches):
        torch.manual_seed(10 + batch)
        ids = torch.randint(3, 100, (4, 63))
        for which, model in (("fp32", reference), ("eager", eager), ("kernelized", kernelized)):
            model.train()
            model.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            (model(input_ids=ids, labels=ids).loss * ACCUMULATION).backward()
            for name, p in model.named_parameters():
                if p.dim() <= 1 and p.grad is not None:
                    grads[which].setdefault(name, []).append(p.grad.detach().double().flatten())
    errors = {}
    for name, parts in grads["fp32"].items():
        truth = torch.cat(parts)
        errors[name] = tuple(float((torch.cat(grads[which][name]) - truth).norm() / truth.norm())
                             for which in ("eager", "kernelized"))
    assert errors, f"{family}: no small parameters"
    return errors


def _assert_as_close_as_eager(family, errors):
    for name, (eager_error, kernel_error) in errors.items():
        # Factor 2: the bound this file allows any gradient that passes back through every layer. Floor: 2**-8,
        # bfloat16's largest relative rounding error, for one rounding more than eager's: the portable loss rounds
        # its stored gradient once in the forward and once more when it scales it in backward.
        assert kernel_error <= 2 * eager_error + 2**-8, \
            f"{family} {name}: gradient error {kernel_error:.2e} vs float32, eager's {eager_error:.2e} (bfloat16)"


@pytest.mark.parametrize("family", SMALL_PARAMETER_FAMILIES)
def test_small_parameter_gradients_are_as_close_to_float32_as_eager(family, pm):
    """bfloat16 training with the kernels kernelize picks here: norm weights, biases and xIELU's scalars get
    gradients as close to the float32 model's as eager's, with the loss's upstream gradient (1/3) applied in
    float32."""
    _assert_as_close_as_eager(family, _small_parameter_errors(family, pm))


class _WeightGradSummedRowByRow(torch.autograd.Function):
    """The reference RMSNorm, but its backward sums the weight gradient one row at a time in the weight's dtype: the
    kind of defect the small-parameter check exists for."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting):
        ctx.save_for_backward(x, weight)
        ctx.options = {"eps": eps, "offset": offset, "casting": casting}
        return reference.rms_norm(x, weight, **ctx.options)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1]).detach().requires_grad_()
        per_row = weight.detach().expand_as(rows).clone().requires_grad_()
        with torch.enable_grad():
            y = reference.rms_norm(rows, per_row, **ctx.options)
            dx, dw_rows = torch.autograd.grad(y, (rows, per_row), dy.reshape(rows.shape))
        dw = torch.zeros_like(weight)
        for row in dw_rows:
            dw = dw + row  # rounded to the weight's dtype at every step
        return dx.reshape(x.shape), dw, None, None, None


def rms_norm_summing_rows_in_half_precision(x, weight, *, eps, offset, casting):
    return _WeightGradSummedRowByRow.apply(x, weight, eps, offset, casting)


class _HalfPrecisionSumPlugin:
    @staticmethod
    @kernels_core.hookimpl
    def kernels_core_kernels():
        return (KernelSpec(id="test.rms_norm.row_sums", kind="rms_norm", variants=("standard", "offset"),
                           backend="any", impl=f"{__name__}:rms_norm_summing_rows_in_half_precision", priority=60,
                           supports=Supports.BACKWARD, dtypes=("float16", "bfloat16", "float32")),)


@pytest.mark.parametrize("family", ["llama", "apertus"])
def test_the_small_parameter_check_catches_a_weight_gradient_summed_in_half_precision(family):
    errors = _small_parameter_errors(family, fresh_plugin_manager((_HalfPrecisionSumPlugin, "row_sums")))
    with pytest.raises(AssertionError, match="gradient error"):
        _assert_as_close_as_eager(family, errors)
