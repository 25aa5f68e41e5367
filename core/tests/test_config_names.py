"""Names in the configuration checked against what is installed: warnings (whatever strict says), options,
sources."""

from __future__ import annotations

import types
import warnings

import kernels_core
import pytest
from kernels_core import ConfigError
from kernels_core import ConfigWarning
from kernels_core import KernelSpec
from kernels_core import KernelsPluginManager
from kernels_core import LayerKind
from kernels_core import Mode
from kernels_core import hookimpl
from kernels_core import load_config
from kernels_core._config_names import check_config
from kernels_core._config_names import config_problems
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


pytest.importorskip("transformers")


def _kernelize(pm, config=None, **kwargs):
    return kernels_core.kernelize(tiny_causal_lm("llama"), mode=Mode.INFERENCE, config=config, plugin_manager=pm,
                                  **kwargs)


def _toml(tmp_path, text):
    path = tmp_path / "kernels.toml"
    path.write_text(text)
    return str(path)


# -- each mistake from the field warns, naming the file and the closest installed name -------------------------

@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        ('[kernels]\ndisable = ["any.rms_norm.recompte"]\n', "kernels.disable",
         "'any.rms_norm.recompte' matches no installed kernel; did you mean 'any.rms_norm.recompute'?"),
        ('[kinds.rms_norm]\ndisable = ["portabel"]\n', "kinds.rms_norm.disable",
         "'portabel' matches no installed kernel or plugin; did you mean 'portable'?"),
        ('[plugins]\nblock = ["portabel"]\n', "plugins.block",
         "'portabel' is not an installed plugin; did you mean 'portable'?"),
        ('[plugins]\nallow = ["buitlin", "portable"]\n', "plugins.allow",
         "'buitlin' is not an installed plugin; did you mean 'builtin'?"),
        ('[kinds.rms_norm]\nprefer = {cpuu = ["any.rms_norm.recompute"]}\n', "kinds.rms_norm.prefer.cpuu",
         "backend 'cpuu' is not declared by any installed plugin; did you mean 'cpu'?"),
        ('[kinds.rms_norm]\nprefer = {any = ["any.rms_norm.recompte", "any.rms_norm.recompute"]}\n',
         "kinds.rms_norm.prefer.any",
         "'any.rms_norm.recompte' matches no installed kernel; did you mean 'any.rms_norm.recompute'?"),
    ],
)
def test_unmatched_name_in_auto_discovered_file_warns_with_file_and_closest_name(tmp_path, pm, text, key, hint):
    path = _toml(tmp_path, text)
    with pytest.warns(ConfigWarning) as record:
        _kernelize(pm)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{path}: {key}: {hint}")
    assert messages[0].endswith("; ignored (an error under warnings.filterwarnings('error', "
                                "category=kernels_core.ConfigWarning))")


def test_unmatched_plugin_name_lists_installed_plugins_when_none_is_close(tmp_path, pm):
    _toml(tmp_path, '[plugins]\nblock = ["nccpuu"]\n')
    with pytest.warns(ConfigWarning, match=r"'nccpuu' is not an installed plugin; installed plugins: "
                                           r"\['builtin', 'portable'\]"):
        _kernelize(pm)


def test_a_warned_name_changes_nothing_else(tmp_path, pm):
    _toml(tmp_path, '[kernels]\ndisable = ["any.rms_norm.recompte"]\n')
    with pytest.warns(ConfigWarning):
        model = _kernelize(pm)
    assert {e.kernel for e in kernels_core.get_report(model).applied if e.kind == "rms_norm"} == {
        "any.rms_norm.recompute"}


def test_a_preferred_list_naming_no_installed_kernel_is_one_error_naming_id_closest_ids_and_source(tmp_path, pm):
    # Warning that the name is ignored and then failing the preference anyway told two different stories: the
    # preference cannot be honoured here (its backend is installed, no listed id is), so it is one error.
    path = _toml(tmp_path, '[kinds.rms_norm]\nprefer = {cpu = ["any.rms_norm.recompte"]}\n')
    for strict in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigWarning)
            with pytest.raises(ConfigError) as raised:
                _kernelize(pm, strict=strict)
        message = str(raised.value)
        assert message.startswith(f"{path}: kinds.rms_norm.prefer.cpu: 'any.rms_norm.recompte' matches no installed "
                                  "kernel; did you mean 'any.rms_norm.recompute'?")
        assert "none of kinds.rms_norm.prefer.cpu is an installed kernel of kind rms_norm" in message
        assert "ignored" not in message
    (problem,) = config_problems(load_config(cwd=tmp_path), pm)
    assert problem.error


def test_a_preferred_list_with_an_installed_kernel_only_warns_for_the_unknown_id(pm):
    # The unknown id is skipped and the next one is used: "ignored" is then what happens.
    config = {"kinds": {"rms_norm": {"prefer": {"cpu": ["any.rms_norm.recompte", "any.rms_norm.recompute"]}}}}
    with pytest.warns(ConfigWarning, match=r"'any.rms_norm.recompte' matches no installed kernel.*; ignored"):
        model = _kernelize(pm, config=config)
    assert {e.kernel for e in kernels_core.get_report(model).applied if e.kind == "rms_norm"} == {
        "any.rms_norm.recompute"}


def test_a_preferred_list_for_a_backend_not_installed_here_only_warns(pm):
    # A configuration shared with another machine: the plugin of that backend is not installed here.
    config = {"kinds": {"rms_norm": {"prefer": {"xpu": ["xpu.rms_norm.fast"]}}}}
    with pytest.warns(ConfigWarning, match="xpu"):
        _kernelize(pm, config=config)


def test_sources_are_named_per_key_across_layers(tmp_path, pm, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.kernels-core.kernels]\ndisable = ["any.rms_norm.recompte"]\n')
    env_file = tmp_path / "env.toml"
    env_file.write_text('[plugins]\nblock = ["portabel"]\n')
    monkeypatch.setenv("KERNELS_CORE_CONFIG", str(env_file))
    with pytest.warns(ConfigWarning) as record:
        _kernelize(pm, config={"kinds": {"rms_norm": {"disable": ["portabel"]}}})
    messages = {str(w.message).split(": ")[1]: str(w.message) for w in record}
    assert len(record) == 3
    assert messages["plugins.block"].startswith(f"KERNELS_CORE_CONFIG={env_file}: plugins.block: 'portabel'")
    assert messages["kernels.disable"].startswith(f"{tmp_path / 'pyproject.toml'} [tool.kernels-core]: "
                                                  "kernels.disable: 'any.rms_norm.recompte'")
    assert messages["kinds.rms_norm.disable"].startswith("config argument: kinds.rms_norm.disable: 'portabel'")


def test_plugin_lists_from_the_environment_are_checked(monkeypatch):
    monkeypatch.setenv("KERNELS_CORE_DISABLE_PLUGINS", "portabel")
    pm = KernelsPluginManager(load_entrypoints=False, strict=True)
    pm.register(kernels_core._builtin, "builtin")
    with pytest.warns(ConfigWarning, match=r"^KERNELS_CORE_DISABLE_PLUGINS=portabel: 'portabel' is not an installed "
                                           r"plugin; installed plugins: \['builtin'\]"):
        _kernelize(pm)


def test_names_of_blocked_or_failed_plugins_are_not_typos(tmp_path):
    def kernels_core_kernels():
        return [KernelSpec(id="demo.rms_norm.k", kind="rms_norm", variants=("standard",), backend="cpu",
                           impl="m:f")]

    demo = types.ModuleType("demo")
    demo.kernels_core_kernels = hookimpl(kernels_core_kernels)
    broken = types.ModuleType("broken")
    broken.kernels_core_kernals = hookimpl(kernels_core_kernels)  # misspelled hook: the plugin fails to register
    pm = KernelsPluginManager(load_entrypoints=False, strict=False, allow=None, block=["demo"])
    pm.register(kernels_core._builtin, "builtin")
    pm.register(demo, "demo")
    pm.register(broken, "broken")
    assert {p.name: p.status for p in pm.plugins} == {"builtin": "loaded", "demo": "blocked", "broken": "failed"}
    cfg = load_config({"plugins": {"block": ["demo", "broken"]}, "kinds": {"rms_norm": {"disable": ["broken"]}}},
                      cwd=tmp_path)
    assert config_problems(cfg, pm) == []
    # Their kernels are not known, and the message says so.
    cfg = load_config({"kernels": {"disable": ["demo.rms_norm.k"]}}, cwd=tmp_path)
    (problem,) = config_problems(cfg, pm)
    assert "plugins ['broken', 'demo'] did not load, so their kernels are not known" in problem.message


def test_kernel_of_another_kind_or_backend_warns(tmp_path, pm):
    config = {"kinds": {"rms_norm": {"disable": ["any.silu_gated_mlp.recompute"],
                                     "prefer": {"cpu": ["any.silu_gated_mlp.recompute", "any.rms_norm.recompute"]}}}}
    with pytest.warns(ConfigWarning) as record:
        _kernelize(pm, config=config)
    messages = sorted(str(w.message) for w in record)
    assert "kinds.rms_norm.disable: kernel 'any.silu_gated_mlp.recompute' implements kind 'silu_gated_mlp', " \
           "never 'rms_norm'" in messages[0]
    assert "kinds.rms_norm.prefer.cpu: kernel 'any.silu_gated_mlp.recompute' implements kind 'silu_gated_mlp', " \
           "never 'rms_norm'; did you mean 'any.rms_norm.recompute'?" in messages[1]
    cfg = load_config({"kinds": {"residual_rms_norm": {"prefer": {"cuda": ["cpu.residual_rms_norm.recompute"]}}}},
                      cwd=tmp_path)
    cuda = types.ModuleType("cuda_backend")
    cuda.kernels_core_detect_devices = hookimpl(
        lambda: [kernels_core.BackendInfo(backend="cuda", device_type="cuda", reason="no GPU")])
    pm.register(cuda, "cuda")
    messages = [str(p) for p in config_problems(cfg, pm)]
    assert messages == ["config argument: kinds.residual_rms_norm.prefer.cuda: kernel "
                        "'cpu.residual_rms_norm.recompute' runs on backend 'cpu', so modules on 'cuda' can never "
                        "use it"]


def test_valid_configuration_is_silent(tmp_path, pm):
    config = {"plugins": {"allow": ["portable"], "block": ["builtin"]},
              "kernels": {"disable": ["any.silu_gated_mlp.recompute"]},
              "kinds": {"silu_gated_mlp": {"disable": ["portable"]},
                        "rms_norm": {"prefer": {"any": ["any.rms_norm.recompute"], "cpu": ["any.rms_norm.recompute"]}},
                        "causal_lm_loss": {"options": {"materialize_logits": True}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_problems(load_config(config, cwd=tmp_path), pm) == []
        _kernelize(pm, config=config)


# -- strict is about kernels, not names ----------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["argument", "file", "kind"])
def test_strict_leaves_names_that_match_nothing_warnings(tmp_path, pm, how):
    text = {"argument": "", "file": "strict = true\n", "kind": "[kinds.rms_norm]\nstrict = true\n"}[how]
    path = _toml(tmp_path, text + '[plugins]\nblock = ["nccpuu"]\n[kinds.rmsnorm]\nenabled = false\n')
    with pytest.warns(ConfigWarning) as record:
        model = _kernelize(pm, strict=how == "argument")
    assert sorted(str(w.message).split(": ")[1] for w in record) == ["kinds.rmsnorm", "plugins.block"]
    assert all(str(w.message).startswith(path) for w in record)
    assert kernels_core.get_report(model).applied


def test_a_warnings_filter_turns_names_into_errors(tmp_path, pm):
    path = _toml(tmp_path, '[plugins]\nblock = ["nccpuu"]\n')
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=ConfigWarning)
        with pytest.raises(ConfigWarning, match=f"^{path}: plugins.block: 'nccpuu' is not an installed plugin"):
            _kernelize(pm)


@pytest.mark.parametrize("value", ["1", "0", "enable"])
def test_the_former_strict_config_variable_is_refused_with_what_replaces_it(pm, monkeypatch, value):
    monkeypatch.setenv("KERNELS_CORE_STRICT_CONFIG", value)
    model = tiny_causal_lm("llama")
    with pytest.raises(ConfigError, match=r"^KERNELS_CORE_STRICT_CONFIG is no longer read: .*"
                                          r'warnings.filterwarnings\("error", category=kernels_core.ConfigWarning\)'):
        kernels_core.kernelize(model, mode=Mode.INFERENCE, plugin_manager=pm)
    assert kernels_core.get_report(model) is None


# -- options -------------------------------------------------------------------------------------------------------

def test_unknown_option_raises_with_the_allowed_ones_and_the_source(tmp_path, pm):
    path = _toml(tmp_path, "[kinds.causal_lm_loss]\noptions = { materialise_logits = true }\n")
    with pytest.raises(ConfigError, match=(
            rf"^{path}: kinds.causal_lm_loss.options.materialise_logits: unknown option 'materialise_logits' for kind "
            r"'causal_lm_loss'; did you mean 'materialize_logits'\?; allowed: \['materialize_logits'\]$")):
        _kernelize(pm)


def test_option_of_a_kind_without_options_raises(pm):
    with pytest.raises(ConfigError, match=r"unknown option 'eps' for kind 'rms_norm'; kind 'rms_norm' takes no "
                                          r"options; allowed: \[\]"):
        _kernelize(pm, config={"kinds": {"rms_norm": {"options": {"eps": 1e-5}}}})


def test_option_of_the_wrong_type_raises(tmp_path, pm):
    path = _toml(tmp_path, '[kinds.causal_lm_loss]\noptions = { materialize_logits = "yes" }\n')
    with pytest.raises(ConfigError, match=f"{path}: kinds.causal_lm_loss.options.materialize_logits: option "
                                          "'materialize_logits' of kind 'causal_lm_loss' expects bool, got str 'yes'"):
        _kernelize(pm)


def test_errors_raise_and_names_that_only_warn_are_not_folded_in(pm):
    with pytest.raises(ConfigError, match="unknown option 'x'") as info:
        _kernelize(pm, config={"kinds": {"rms_norm": {"options": {"x": 1}}}, "plugins": {"block": ["nccpuu"]}})
    assert "nccpuu" not in str(info.value), "a name that only warns is not part of the error"


def _kind_plugin(options):
    plugin = types.ModuleType("kinds_plugin")
    plugin.kernels_core_layer_kinds = hookimpl(lambda: [LayerKind(
        name="plain_mlp", description="x", variants=("gelu",), matcher="m:f", adapter="m:g", options=options)])
    return plugin


def test_plugin_kind_options_follow_its_declaration(tmp_path):
    undeclared = fresh_plugin_manager((_kind_plugin(None), "acme"))
    cfg = load_config({"kinds": {"plain_mlp": {"options": {"anything": [1, 2]}}}}, cwd=tmp_path)
    assert config_problems(cfg, undeclared) == [], "a kind that declares no options leaves them unchecked"
    declared = fresh_plugin_manager((_kind_plugin({"chunk": int, "scale": (int, float)}), "acme"))
    ok = load_config({"kinds": {"plain_mlp": {"options": {"chunk": 3, "scale": 2}}}}, cwd=tmp_path)
    assert config_problems(ok, declared) == []
    bad = load_config({"kinds": {"plain_mlp": {"options": {"chunk": True, "scale": "2"}}}}, cwd=tmp_path)
    assert [p.message for p in config_problems(bad, declared)] == [
        "option 'chunk' of kind 'plain_mlp' expects int, got bool True",
        "option 'scale' of kind 'plain_mlp' expects int or float, got str '2'",
    ]


@pytest.mark.parametrize(("options", "message"), [
    ({"Bad-Name": bool}, "option name 'Bad-Name' must be a snake_case name"),
    ({"flag": "bool"}, "option 'flag' must map to a type or a tuple of types, got 'bool'"),
    ({"flag": ()}, "option 'flag' must map to a type or a tuple of types"),
    (["flag"], "options must be a mapping of name to type or None"),
])
def test_layer_kind_validates_its_option_declaration(options, message):
    with pytest.raises(ValueError, match=message):
        LayerKind(name="k", description="x", variants=("a",), matcher="m:f", adapter="m:g", options=options)


def test_core_kinds_declare_the_options_their_adapters_read(pm):
    declared = {name: provided.kind.options for name, provided in pm.layer_kinds().items()}
    assert declared.pop("causal_lm_loss") == {"materialize_logits": bool}
    assert declared.pop("linear") == {"lm_head": bool}  # read by the matcher (MatchContext.options)
    assert declared.pop("silu_gated_mlp") == declared.pop("gelu_gated_mlp") == {"recompute_product": bool}
    assert declared and all(options == {} for options in declared.values())
    assert len({provided.kind for provided in pm.layer_kinds().values()}) == len(pm.layer_kinds()), "kinds hash"


# -- unknown kinds, warning mechanics ------------------------------------------------------------------------------

def test_unknown_kind_warns_naming_its_source_and_the_closest_kind_and_changes_nothing_else(tmp_path, pm):
    # A shared file may configure a kind only another machine's plugin provides (npu's attention on a CUDA host).
    path = _toml(tmp_path, '[kinds.rmsnorm]\nenabled = false\n[kinds.npu_attention]\nprefer = {npu = ["npu.fa"]}\n'
                           'options = { anything = 1 }\n')
    with pytest.warns(ConfigWarning) as record:
        model = _kernelize(pm)
    messages = sorted(str(w.message) for w in record if w.category is ConfigWarning)
    assert len(messages) == 2, messages
    assert messages[1].startswith(f"{path}: kinds.rmsnorm: unknown layer kind 'rmsnorm'; did you mean 'rms_norm'?; "
                                  "installed kinds: [")
    # The closest installed kind may be suggested (another *_attention kind), never taken.
    assert messages[0].startswith(f"{path}: kinds.npu_attention: unknown layer kind 'npu_attention'; ")
    assert "installed kinds: [" in messages[0]
    assert messages[0].endswith("; ignored (an error under warnings.filterwarnings('error', "
                                "category=kernels_core.ConfigWarning))")
    assert any(e.kernel == "any.rms_norm.recompute" for e in kernels_core.get_report(model).entries)


def test_warning_points_at_the_caller_and_shows_once_per_call_site(tmp_path, pm):
    _toml(tmp_path, '[plugins]\nblock = ["nccpuu"]\n')
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        for _ in range(3):
            _kernelize(pm)
    assert len(record) == 1
    assert record[0].category is ConfigWarning
    assert record[0].filename == __file__


def test_disabled_kernelize_does_not_check_names(tmp_path, pm, monkeypatch):
    _toml(tmp_path, '[plugins]\nblock = ["nccpuu"]\n')
    monkeypatch.setenv("KERNELS_CORE_DISABLE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _kernelize(pm)
    assert kernels_core.get_report(model).disabled


def test_check_config_returns_the_warned_problems(tmp_path, pm):
    cfg = load_config({"plugins": {"block": ["nccpuu"]}}, cwd=tmp_path)
    with pytest.warns(ConfigWarning):
        problems = check_config(cfg, pm)
    assert [(p.source, p.key, p.error) for p in problems] == [("config argument", "plugins.block", False)]


def test_config_warning_is_public():
    assert "ConfigWarning" in kernels_core.__all__
    assert issubclass(ConfigWarning, UserWarning)
