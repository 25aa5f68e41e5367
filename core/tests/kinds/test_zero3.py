"""DeepSpeed ZeRO-3 partitioned parameters: probes gather them, and the two kinds that read a child's weight without
calling the child (the fused loss reads ``lm_head.weight``, the residual add + norm ``post_attention_layernorm``'s)
run between that child's DeepSpeed hooks.

Everything here runs on ``zero3_standin`` (one process, no deepspeed needed): it partitions the parameters as
``deepspeed.zero.Init`` does (empty data, ``ds_*`` attributes) and registers the engine's four hooks per module and
its gradient reduction per parameter. Three orders: kernelize, then partition and build the engine ("before");
partition, kernelize, then the engine ("init": what a Trainer does when the model loads under ZeRO-3's
``zero.Init``); partition and the engine, then kernelize ("after"). Each must give the losses and every gradient
(lm_head's and the norms' included) of the same model without kernels-core under the stand-in, with the kernels
running. The same checks with real DeepSpeed: ``core/tests/integrations/test_deepspeed.py``.
"""

from __future__ import annotations

import sys

import kernels_core
import pytest
import torch
import zero3_standin
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_causal_lm


pytest.importorskip("transformers")

ORDERS = ("before", "init", "after")
STEPS = 2
LR = 0.05


def _model(family: str = "qwen3", **overrides) -> torch.nn.Module:
    model = tiny_causal_lm(family, **overrides).train()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # away from ones / zeros, so a kernel that drops or misreads a norm weight shows
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def _prepare(model: torch.nn.Module, order: str, pm, **partition_options) -> tuple[zero3_standin.Engine,
                                                                                   zero3_standin.Stats]:
    if order == "before":
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    stats = zero3_standin.partition(model, **partition_options)
    if order == "init":
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    engine = zero3_standin.Engine(model)
    if order == "after":
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    return engine, stats


def _train(model: torch.nn.Module, engine: zero3_standin.Engine) -> list[tuple[torch.Tensor, dict]]:
    gen = torch.Generator().manual_seed(11)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(3, 100, (2, 9), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {name: p.ds_grad for name, p in model.named_parameters()}
        engine.step(LR)
        steps.append((loss.detach(), grads))
    return steps


def _eager(family: str = "qwen3", **partition_options) -> tuple[list, zero3_standin.Stats]:
    model = _model(family)
    engine, stats = _prepare(model, "eager", None, **partition_options)
    return _train(model, engine), stats


def _assert_same(steps: list, expected: list, what: str) -> None:
    for i, ((loss, grads), (eager_loss, eager_grads)) in enumerate(zip(steps, expected, strict=True)):
        assert_close(loss, eager_loss, factor=2, what=f"{what}: step {i} loss")
        for name, grad in eager_grads.items():
            assert grads[name] is not None, f"{what}: step {i}: no gradient reached {name}"
            assert_close(grads[name], grad, factor=5, what=f"{what}: step {i} gradient of {name}")


def _applied(model: torch.nn.Module, kind: str) -> list:
    entries = [e for e in kernels_core.get_report(model).entries if e.kind == kind]
    assert entries, f"no module matched as {kind}"
    return [f"{e.module}: {e.reason}" for e in entries if not (e.applied or e.covered)]


@pytest.fixture(scope="module")
def eager() -> tuple[list, dict[str, int]]:
    """The Qwen3 model without kernels-core under the stand-in, checked against the plain model (the stand-in is
    faithful): each step's loss and gradients, and how often training gathered each parameter."""
    steps, stats = _eager()
    plain = _model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(11)
    for loss, grads in steps:
        ids = torch.randint(3, 100, (2, 9), generator=gen)
        plain_loss = plain(input_ids=ids, labels=ids).loss
        plain_loss.backward()
        assert_close(loss, plain_loss.detach(), what="stand-in loss")
        for name, param in plain.named_parameters():
            assert_close(grads[name], param.grad, what=f"stand-in gradient of {name}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps, dict(stats.gathers)


@pytest.mark.parametrize("plugin", ["reference", "portable"])
@pytest.mark.parametrize("order", ORDERS)
def test_fused_loss_and_residual_norm_train_like_eager_in_every_order(order, plugin, eager, ref_pm, pm, calls):
    """Losses and every gradient equal to the eager model under the stand-in, with the fused loss and the
    residual add + norm kernels running (the reference plugin's loss keeps the weight for its backward; the
    portable one computes the weight gradient in its forward), and nothing left gathered after a step."""
    expected, eager_gathers = eager
    model = _model()
    engine, stats = _prepare(model, order, ref_pm if plugin == "reference" else pm)
    for kind in ("causal_lm_loss", "residual_rms_norm", "rms_norm", "silu_gated_mlp"):
        assert not _applied(model, kind), f"{order}: {kind} not applied: {_applied(model, kind)}"
    calls.clear()
    stats.gathers.clear()  # what training gathers, not the probes
    steps = _train(model, engine)
    _assert_same(steps, expected, f"{order} ({plugin})")
    if plugin == "reference":
        assert calls["causal_lm_loss"] == STEPS, "the fused loss did not run (the model's own forward did)"
        assert calls["residual_rms_norm"] == STEPS * model.config.num_hidden_layers
    for name, param in model.named_parameters():
        assert param.ds_status is zero3_standin.ZeroParamStatus.NOT_AVAILABLE and param.numel() == 0, (
            f"{name} left gathered after the step")
    # Gathered as the modules' own hooks gather them: once for the forward, once for the backward, every step.
    for name in ("lm_head.weight", "model.layers.0.post_attention_layernorm.weight"):
        assert stats.gathers[name] == eager_gathers[name] == 2 * STEPS, (name, stats.gathers[name])


def test_tied_embeddings_and_persistent_norms(ref_pm, calls):
    """lm_head sharing the embedding's weight, and norm weights kept whole (``stage3_param_persistence_threshold``
    above their size): the same losses and gradients, the kernels running. ZeRO-3 is handled through what the
    parameters carry: deepspeed is never imported."""
    imported_before = "deepspeed" in sys.modules
    persist = {"model.norm.weight", *(f"model.layers.{i}.{n}.weight" for i in range(2)
                                      for n in ("input_layernorm", "post_attention_layernorm"))}
    expected, _ = _eager_tied(persist)
    model = _model(tie_word_embeddings=True)
    engine, _ = _prepare(model, "init", ref_pm, persist=persist)
    calls.clear()
    _assert_same(_train(model, engine), expected, "tied, persistent norms")
    assert calls["causal_lm_loss"] == STEPS and calls["residual_rms_norm"] == 2 * STEPS
    assert imported_before or "deepspeed" not in sys.modules


def _eager_tied(persist: set[str]) -> tuple[list, zero3_standin.Stats]:
    model = _model(tie_word_embeddings=True)
    engine, stats = _prepare(model, "eager", None, persist=persist)
    return _train(model, engine), stats


def test_offset_norms_are_probed_on_their_gathered_weights(ref_pm):
    """Gemma's (1 + w) norms partitioned before kernelize: the probes gather the weights, so each norm gets the
    offset variant and the losses are eager's. A probe on the empty partitions cannot tell w from 1 + w."""
    expected, _ = _eager("gemma")
    model = _model("gemma")
    engine, _ = _prepare(model, "init", ref_pm)
    variants = {e.variant for e in kernels_core.get_report(model).entries if e.kind in ("rms_norm",
                                                                                       "residual_rms_norm")}
    assert variants == {"offset"}, variants
    _assert_same(_train(model, engine), expected, "gemma, partitioned before kernelize")
    assert all(p.numel() == 0 for p in model.parameters()), "kernelize left parameters gathered"


def test_a_parameter_in_flight_is_declined_with_the_reason(ref_pm):
    """A probe never runs on a parameter DeepSpeed is still fetching: that module is declined, saying why."""
    model = _model()
    zero3_standin.partition(model)
    model.model.layers[0].mlp.down_proj.weight.ds_status = zero3_standin.ZeroParamStatus.INFLIGHT
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    entries = {e.module: e for e in kernels_core.get_report(model).entries if e.kind == "silu_gated_mlp"}
    assert entries["model.layers.0.mlp"].kernel is None
    assert "being fetched" in entries["model.layers.0.mlp"].reason
    assert all(p.numel() == 0 for p in model.parameters()), "kernelize left parameters gathered"


@pytest.mark.parametrize("order", ["init", "after"])
def test_hooks_of_another_origin_beside_deepspeeds(order, eager, ref_pm, calls):
    """A forward hook of another origin (DeepSpeed's flops profiler, a user's) on lm_head and on
    post_attention_layernorm, beside DeepSpeed's, registered after kernelize: the partitioned weight is gathered
    only by calling the child, so the model's own forward and the norm module run (the hooks with them), and the
    losses and gradients stay eager's."""
    model = _model()
    engine, _ = _prepare(model, order, ref_pm)
    seen: list[str] = []
    model.lm_head.register_forward_hook(lambda m, a, o: seen.append("lm_head"))
    model.model.layers[1].post_attention_layernorm.register_forward_hook(lambda m, a, o: seen.append("norm"))
    calls.clear()
    from kernels_core import KernelFallbackWarning

    # The fused loss warns once that the model's own forward computes the loss, and the report says so.
    with pytest.warns(KernelFallbackWarning, match="hooks of another origin"):
        _assert_same(_train(model, engine), eager[0], f"{order}, hooks of another origin")
    assert seen == ["norm", "lm_head"] * STEPS
    assert calls["causal_lm_loss"] == 0 and calls["residual_rms_norm"] == STEPS, dict(calls)
    (row,) = [e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss"]
    assert not row.applied and row.fell_back == "ref.causal_lm_loss" and "only calling lm_head" in row.reason, row


def test_access_and_hook_recognition():
    from kernels_core._kinds import _zero3

    linear = torch.nn.Linear(4, 3)
    assert _zero3.access(linear, linear.weight) == _zero3.DIRECT
    zero3_standin.partition(linear)
    assert _zero3.full_shape(linear.weight) == (3, 4) and linear.weight.shape == (0,)
    assert _zero3.access(linear, linear.weight) == _zero3.MODULE, "a partitioned weight nothing gathers"
    with pytest.raises(RuntimeError, match="not gathered"):
        _zero3.require_whole(linear.weight, "weight")
    zero3_standin.Engine(linear)
    assert _zero3.hooks_problem(linear) is None
    assert _zero3.access(linear, linear.weight) == _zero3.HOOKS
    linear.register_forward_hook(lambda m, a, o: None)
    assert "forward hook" in _zero3.hooks_problem(linear)
    assert _zero3.access(linear, linear.weight) == _zero3.MODULE, "only calling the module gathers the weight"
    plain = torch.nn.Linear(4, 3)
    plain.register_forward_hook(lambda m, a, o: None)
    assert _zero3.access(plain, plain.weight) == _zero3.DIRECT, "hooks on whole weights: the matcher's business"


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_partitioned_lora_head_runs_the_models_own_loss_and_the_report_says_so(order, pm):
    """A PEFT LoRA lm_head keeps its parameters in child modules, which its own ZeRO-3 hooks do not gather: the fused
    loss cannot read them, so the model's own forward computes the loss (with a warning), and get_report shows the
    loss kernel as fallen back with that reason instead of claiming it runs."""
    peft = pytest.importorskip("peft", reason="a LoRA head needs peft: pip install 'kernels-core[peft]'")
    from kernels_core import KernelFallbackWarning

    model = peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    model.train()
    _prepare(model, order, pm)
    head = model.base_model.model.lm_head
    assert any(getattr(p, "ds_id", None) is not None for p in head.parameters()), "the stand-in partitions the head"
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(11))
    with pytest.warns(KernelFallbackWarning, match="PEFT.*partitions"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model.base_model.model.lm_head.lora_B["default"].weight.ds_grad is not None, "the LoRA head trains"
    (row,) = [e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss"]
    assert not row.applied and row.fell_back and "partitions" in row.reason, row
    assert "fell back" in kernels_core.get_report(model).summary()
