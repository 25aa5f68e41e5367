"""The report is true to the call: every kernel it lists runs where it says, and strict means what it documents.

Call counting rebuilds every bound forward with each kernel implementation wrapped in a counter tagged with the
module it was bound to, then runs a training step (in inference, an evaluation forward with labels): a kernel
listed for a module must run there once per forward, and no kernel may run on a module the report does not list
it for. A module whose math a kernel on an enclosing module computes is reported as covered by that kernel, gets
no binding and its forward never runs.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections import Counter

import kernels_core
import pytest
import torch
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import LayerKind
from kernels_core import Match
from kernels_core import Mode
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import FAMILIES
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")


class _FreshNamespaces(dict):
    """Stands in for the rerouted-namespace cache: never hits, so every rebuild makes its own namespaces."""

    def get(self, key, default=None):
        return default


def _count_kernel_calls(model, monkeypatch) -> Counter:
    """Rebuild every bound forward so that each kernel call counts as (module name, kernel id)."""
    from kernels_core import _forward
    from kernels_core._binding import BINDING_ATTR
    from kernels_core._binding import forward_slot

    counts: Counter = Counter()
    real_load_ref = _forward.load_ref

    def counting(impl, name, kernel_id):
        def counted(*args, **kwargs):
            counts[(name, kernel_id)] += 1
            return impl(*args, **kwargs)
        return counted

    monkeypatch.setattr(_forward, "_REROUTED_NAMESPACES", _FreshNamespaces())
    for name, module in model.named_modules():
        if BINDING_ATTR not in module.__dict__:
            continue
        bound = _forward.forward_object(module.__dict__[forward_slot(module)])
        if isinstance(bound, _forward.KernelForward):
            kernels = {bound.impl: bound.kernel_id}
        else:
            assert isinstance(bound, _forward.ReroutedForward), f"{name}: unexpected binding {bound!r}"
            kernels = {o.impl: o.kernel_id for o in bound.overrides}

        def load_ref(ref, name=name, kernels=kernels):
            impl = real_load_ref(ref)
            return counting(impl, name, kernels[ref]) if ref in kernels else impl

        with monkeypatch.context() as patch:
            patch.setattr(_forward, "load_ref", load_ref)
            bound._fn = bound._build()
    return counts


def _forward_calls(model, names, monkeypatch) -> Counter:
    """Count calls of the given modules' own class forwards. Not with forward hooks: a kernel that computes a module
    without calling it falls back when that module has hooks (they would be bypassed), which is what this counts."""
    calls: Counter = Counter()
    modules = dict(model.named_modules())
    watched = {id(modules[name]): name for name in names}
    for cls in {type(modules[name]) for name in names}:
        def counting(self, *args, _forward=cls.forward, **kwargs):
            if id(self) in watched:
                calls.update([watched[id(self)]])
            return _forward(self, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", counting)
    return calls


@pytest.mark.parametrize("mode", [Mode.TRAINING, Mode.INFERENCE], ids=["training", "inference"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_reported_kernel_runs_where_the_report_says(family, mode, ref_pm, monkeypatch):
    model = tiny_causal_lm(family)
    kernels_core.kernelize(model, mode=mode, plugin_manager=ref_pm)
    report = kernels_core.get_report(model)
    claimed = Counter((e.module, e.kernel) for e in report.applied)
    covered = [e.module for e in report.covered]
    counts = _count_kernel_calls(model, monkeypatch)
    forwards = _forward_calls(model, covered, monkeypatch)
    ids = torch.randint(3, 100, (2, 7))
    if mode == Mode.TRAINING:
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        # Evaluation with labels: the hardest inference call for the loss kind, which must not claim to run.
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, labels=ids)

    # packed_attention's kernels run on the calls whose mask is causal per document (packed rows): checked with
    # such a row below, left out of this call's count.
    packed = Counter((e.module, e.kernel) for e in report.applied if e.kind == "packed_attention")
    expected = claimed - packed
    if mode == Mode.TRAINING:
        # A gated MLP's kernel runs a second time in backward: down_proj gets act(gate) * up back from it instead
        # of keeping it (recompute_product, on by default).
        expected.update(Counter({key: 1 for key in expected if key[1].endswith("gated_mlp")}))
    assert dict(counts) == dict(expected), (
        f"{family} ({mode}): kernel calls per (module, kernel) differ from the report\n"
        f"ran but not reported: {sorted(set(counts) - set(expected))}\n"
        f"reported but never ran: {sorted(set(expected) - set(counts))}\n{report}"
    )
    counts.clear()
    with torch.no_grad():  # two documents a row, restarting position ids, no cache: transformers masks per document
        model(input_ids=ids, position_ids=torch.tensor([0, 1, 2, 0, 1, 2, 3]).expand(2, -1))
    assert {key: n for key, n in counts.items() if key in packed} == dict(packed), f"{family}: {report}"
    ran = Counter(kernel for _, kernel in claimed)
    assert report.summary().endswith("[" + ", ".join(f"{k} x{n}" for k, n in sorted(ran.items())) + "]")
    assert not forwards, f"{family}: modules reported as covered ran their own forward: {dict(forwards)}"


def test_post_attention_norm_is_covered_by_the_decoder_kernel(ref_pm, calls):
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=ref_pm)
    report = kernels_core.get_report(model)
    layers = model.config.num_hidden_layers
    rows = {e.module: e for e in report.entries if e.kind == "rms_norm"}
    for i in range(layers):
        entry = rows[f"model.layers.{i}.post_attention_layernorm"]
        assert not entry.applied and entry.covered
        assert (entry.covered_by, entry.covered_on) == ("ref.residual_rms_norm", f"model.layers.{i}")
        assert f"covered by ref.residual_rms_norm on model.layers.{i}" in entry.reason
        assert "forward" not in model.model.layers[i].post_attention_layernorm.__dict__, "no binding of its own"
    # In inference the only module left without a kernel is the loss, which runs only in training.
    assert len(report.covered) == layers and [e.kind for e in report.skipped] == ["causal_lm_loss"]
    assert "ref.rms_norm x3" in report.summary() and f"{layers} computed by a kernel on an enclosing" in \
        report.summary()
    data = json.loads(report.to_json())
    covered = [e for e in data["entries"] if e["covered_by"]]
    assert [e["covered_on"] for e in covered] == [f"model.layers.{i}" for i in range(layers)]
    assert all(e["kernel"] is None for e in covered)
    table = report.table()
    assert "covered by ref.residual_rms_norm on model.layers.*" in table
    calls.clear()
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 5)))
    assert calls["rms_norm"] == 3 == sum(1 for e in report.applied if e.kind == "rms_norm")


def test_a_mask_function_the_forward_never_calls_is_not_reported_as_a_kernel(pm):
    # Mistral's forward calls create_sliding_window_causal_mask instead of create_causal_mask when the config sets
    # a window: a kernel rerouting create_causal_mask there would never run.
    windowed = kernels_core.kernelize(tiny_causal_lm("mistral", sliding_window=4), mode=Mode.INFERENCE,
                                      plugin_manager=pm)
    (entry,) = [e for e in kernels_core.get_report(windowed).entries if e.kind == "causal_mask"]
    assert entry.kernel is None and "config.sliding_window = 4" in entry.reason
    assert "forward" not in windowed.model.__dict__
    full = kernels_core.kernelize(tiny_causal_lm("mistral", sliding_window=None), mode=Mode.INFERENCE,
                                  plugin_manager=pm)
    (entry,) = [e for e in kernels_core.get_report(full).entries if e.kind == "causal_mask"]
    assert entry.kernel == "any.causal_mask.sdpa_is_causal"


def test_the_norm_gets_its_own_kernel_when_the_decoder_kernel_is_not_bound(ref_pm, calls):
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, plugin_manager=ref_pm,
                                   config={"kinds": {"residual_rms_norm": {"enabled": False}}})
    report = kernels_core.get_report(model)
    assert not report.covered
    norms = [e for e in report.entries if e.module.endswith("post_attention_layernorm")]
    assert norms and all(e.kernel == "ref.rms_norm" for e in norms)
    calls.clear()
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 5)))
    assert calls["rms_norm"] == 5 and calls["residual_rms_norm"] == 0


# A third-party kind computing a whole gated MLP itself: it declares the projections it never calls, and a
# second kind that would bind every linear sees those covered.
LINEAR_CALLS: Counter = Counter()


def match_whole_mlp(module, name, ctx):
    if not all(isinstance(module._modules.get(n), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    bypasses = ("gate_proj", "up_proj", "down_proj", *getattr(module, "_test_extra_bypass", ()))
    return Match("whole_mlp", "silu", bypasses=bypasses)


def adapt_whole_mlp(module, match, impl, options):
    return lambda x: impl(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)


def whole_mlp(x, gate, up, down):
    f = torch.nn.functional
    return f.linear(f.silu(f.linear(x, gate)) * f.linear(x, up), down)


def match_linear(module, name, ctx):
    return Match("plain_linear", "no_bias") if type(module) is torch.nn.Linear and module.bias is None else None


def adapt_linear(module, match, impl, options):
    return lambda x: impl(x, module.weight)


def linear(x, weight):
    LINEAR_CALLS["linear"] += 1
    return torch.nn.functional.linear(x, weight)


def _third_party_pm():
    plugin = types.ModuleType("plugin_whole_mlp")
    plugin.kernels_core_layer_kinds = hookimpl(lambda: [
        LayerKind(name="whole_mlp", description="gated MLP in one kernel", variants=("silu",),
                  matcher=f"{__name__}:match_whole_mlp", adapter=f"{__name__}:adapt_whole_mlp"),
        LayerKind(name="plain_linear", description="bias-free linear", variants=("no_bias",),
                  matcher=f"{__name__}:match_linear", adapter=f"{__name__}:adapt_linear"),
    ])
    plugin.kernels_core_kernels = hookimpl(lambda: [
        KernelSpec(id="any.whole_mlp.test", kind="whole_mlp", variants=("silu",), backend="any",
                   impl=f"{__name__}:whole_mlp", supports=Supports.BACKWARD),
        KernelSpec(id="any.plain_linear.test", kind="plain_linear", variants=("no_bias",), backend="any",
                   impl=f"{__name__}:linear", supports=Supports.BACKWARD),
    ])
    return fresh_plugin_manager((plugin, "whole_mlp"))


def test_a_third_party_kind_declares_the_children_its_kernel_computes():
    model = tiny_causal_lm("llama")
    eager = model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits
    config = {"kinds": {"silu_gated_mlp": {"enabled": False}}}
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=_third_party_pm(), config=config)
    report = kernels_core.get_report(model)
    linears = {e.module: e for e in report.entries if e.kind == "plain_linear"}
    for i in range(model.config.num_hidden_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            entry = linears[f"model.layers.{i}.mlp.{proj}"]
            assert (entry.covered_by, entry.covered_on) == ("any.whole_mlp.test", f"model.layers.{i}.mlp")
        assert linears[f"model.layers.{i}.self_attn.q_proj"].kernel == "any.plain_linear.test"
    LINEAR_CALLS.clear()
    out = model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits
    torch.testing.assert_close(out, eager)
    assert LINEAR_CALLS["linear"] == sum(1 for e in report.applied if e.kind == "plain_linear")


def test_a_match_naming_a_missing_child_is_declined_with_the_name(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaMLP

    monkeypatch.setattr(LlamaMLP, "_test_extra_bypass", ("activation",), raising=False)
    model = tiny_causal_lm("llama")
    before = {n: dict(m.__dict__) for n, m in model.named_modules()}
    kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=_third_party_pm(),
                           config={"kinds": {"silu_gated_mlp": {"enabled": False}}})
    rows = [e for e in kernels_core.get_report(model).entries if e.kind == "whole_mlp"]
    assert rows and all(e.kernel is None and "'activation'" in e.reason and "LlamaMLP" in e.reason for e in rows)
    assert not any(e.covered_by == "any.whole_mlp.test" for e in kernels_core.get_report(model).entries)
    kernels_core.unkernelize(model)
    assert {n: dict(m.__dict__) for n, m in model.named_modules()} == before


# Strict: "every matched module that could get a kernel on its backend got one".

def _snapshot(model):
    return {name: dict(module.__dict__) for name, module in model.named_modules()}


def rotary(q, k, cos, sin, unsqueeze_dim=1):
    return kernels_core.testing.reference.rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _rotary_pm(**spec):
    fields = {"id": "cpu.rotary_embedding.test", "kind": "rotary_embedding", "variants": ("full",),
              "backend": "cpu", "impl": f"{__name__}:rotary", "supports": Supports.BACKWARD, **spec}
    plugin = types.ModuleType("plugin_rotary")
    plugin.kernels_core_kernels = hookimpl(lambda: [KernelSpec(**fields)])
    return fresh_plugin_manager((plugin, "rotary"))


def test_strict_kernelizes_a_llama_on_a_cpu_host(pm):
    model = tiny_causal_lm("llama")
    for mode in (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE):
        kernels_core.kernelize(model, mode=mode, strict=True, plugin_manager=pm)
        report = kernels_core.get_report(model)
        rotary_rows = [e for e in report.entries if e.kind == "rotary_embedding"]
        assert rotary_rows and all("no kernel for backend cpu" in e.reason for e in rotary_rows)
        assert report.applied
    # The same rule for one kind: no CPU rotary kernel exists, so strict on that kind is met.
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm,
                           config={"kinds": {"rotary_embedding": {"strict": True}}})


@pytest.mark.parametrize(("spec", "why"), [
    ({"dtypes": ("bfloat16",)}, "dtype unsupported"),
    ({"supports": Supports.NONE}, "mode unsupported"),
    ({"variants": ("interleaved",)}, "variant unsupported"),
    ({"requires": ("kernels-core-no-such-package>=1",)}, "requirement missing"),
    ({"impl": f"{__name__}:no_such_function"}, "failed to load"),
])
def test_strict_raises_when_a_kernel_for_the_backend_exists_but_cannot_be_used(spec, why):
    pm = _rotary_pm(**spec)
    model = tiny_causal_lm("llama")
    # A kernel that fails to load is an automatic fallback: warned about once per process, here.
    loud = pytest.warns(kernels_core.KernelFallbackWarning) if why == "failed to load" else contextlib.nullcontext()
    with loud:
        kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    before, report_before = _snapshot(model), kernels_core.get_report(model)
    with pytest.raises(KernelizeError, match=rf"strict kernelize: 2 matched module\(s\).*self_attn "
                                             rf"\(rotary_embedding\): cpu\.rotary_embedding\.test: {why}"):
        kernels_core.kernelize(model, mode=Mode.TRAINING, strict=True, plugin_manager=pm)
    assert _snapshot(model) == before, "a failed strict kernelize must leave every module exactly as it was"
    assert kernels_core.get_report(model) is report_before
    with pytest.raises(KernelizeError, match="rotary_embedding"):
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm,
                               config={"kinds": {"rotary_embedding": {"strict": True}}})
    # Exempting the kind keeps global strict for the others.
    kernels_core.kernelize(model, mode=Mode.TRAINING, strict=True, plugin_manager=pm,
                           config={"kinds": {"rotary_embedding": {"strict": False}}})


@pytest.mark.parametrize("config", [
    {"kernels": {"disable": ["cpu.rotary_embedding.test"]}},
    {"kinds": {"rotary_embedding": {"disable": ["rotary"]}}},
    {"plugins": {"block": ["rotary"]}},
    {"kinds": {"rotary_embedding": {"enabled": False}}},
], ids=["kernel", "kind-plugin", "plugin", "kind"])
def test_strict_accepts_what_configuration_disabled(config):
    pm = _rotary_pm(dtypes=("bfloat16",))
    model = kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.TRAINING, strict=True, plugin_manager=pm,
                                   config=config)
    rows = [e for e in kernels_core.get_report(model).entries if e.kind == "rotary_embedding"]
    assert rows and all(e.kernel is None and "disabled by config" in e.reason for e in rows)
