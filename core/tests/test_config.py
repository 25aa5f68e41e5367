"""Configuration sources, precedence and validation."""

from __future__ import annotations

import pytest
from kernels_core import ConfigError
from kernels_core import load_config


def test_precedence_argument_over_environment_over_file(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.kernels-core]\nstrict = true\n[tool.kernels-core.kinds.rms_norm]\nprefer = {cpu = ["from.file"]}\n'
        'disable = ["file.disabled"]\n'
    )
    env_file = tmp_path / "env.toml"
    env_file.write_text('[kinds.rms_norm]\nprefer = {cpu = ["from.env"]}\n')
    monkeypatch.setenv("KERNELS_CORE_CONFIG", str(env_file))
    cfg = load_config(None, cwd=tmp_path)
    assert cfg.kind("rms_norm").prefer["cpu"] == ("from.env",)
    assert cfg.kind("rms_norm").disable == {"file.disabled"}, "layers merge key by key"
    assert cfg.strict is True
    cfg = load_config({"kinds": {"rms_norm": {"prefer": {"cpu": ["from.arg"]}}}, "strict": False}, cwd=tmp_path)
    assert cfg.kind("rms_norm").prefer["cpu"] == ("from.arg",)
    assert cfg.strict is False
    assert cfg.sources[-1] == "config argument"


def test_kernels_toml_wins_over_pyproject_and_toml_path_argument(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.kernels-core]\nstrict = true\n")
    (tmp_path / "kernels.toml").write_text("strict = false\n[plugins]\nblock = ['npu']\n")
    cfg = load_config(None, cwd=tmp_path)
    assert cfg.strict is False and cfg.block_plugins == {"npu"}
    explicit = tmp_path / "explicit.toml"
    explicit.write_text("[kernels]\ndisable = ['a.b']\n")
    assert load_config(str(explicit), cwd=tmp_path).disabled_kernels == {"a.b"}


def test_disable_environment_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_CORE_DISABLE", "1")
    cfg = load_config(None, cwd=tmp_path)
    assert cfg.disable and "KERNELS_CORE_DISABLE=1" in cfg.sources


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"stict": True}, r"unknown key\(s\) \['stict'\] in the top level; allowed: \['disable', 'kernels'"),
        ({"strict": "yes"}, "strict: expected true or false"),
        ({"plugins": {"allow": [1]}}, "plugins.allow: expected a list of strings"),
        ({"kinds": {"rms_norm": {"prefer": ["x"]}}}, r"kinds.rms_norm.prefer: expected \{backend = \[ids\]\}"),
    ],
)
def test_malformed_values_name_key_and_allowed_values(data, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load_config(data, cwd=tmp_path)


def test_invalid_toml_names_the_file(tmp_path):
    (tmp_path / "kernels.toml").write_text("strict = = true\n")
    with pytest.raises(ConfigError, match="kernels.toml: invalid TOML"):
        load_config(None, cwd=tmp_path)


# -- boolean environment variables: documented values only -------------------------------------------------------

@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("TRUE", True), ("yes", True), (" On ", True),
                                               ("0", False), ("false", False), ("No", False), ("OFF", False)])
def test_disable_switch_accepts_documented_booleans(monkeypatch, tmp_path, raw, expected):
    monkeypatch.setenv("KERNELS_CORE_DISABLE", raw)
    assert load_config(None, cwd=tmp_path).disable is expected


def test_empty_disable_switch_is_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_CORE_DISABLE", " ")
    cfg = load_config(None, cwd=tmp_path)
    assert cfg.disable is False and cfg.sources == ()


def test_disable_switch_off_overrides_the_file(monkeypatch, tmp_path):
    (tmp_path / "kernels.toml").write_text("disable = true\n")
    monkeypatch.setenv("KERNELS_CORE_DISABLE", "0")
    cfg = load_config(None, cwd=tmp_path)
    assert cfg.disable is False and cfg.origin("disable") == "KERNELS_CORE_DISABLE=0"


@pytest.mark.parametrize("variable", ["KERNELS_CORE_DISABLE", "KERNELS_CORE_STRICT_PLUGINS",
                                      "KERNELS_CORE_TRACE_PLUGINS"])
@pytest.mark.parametrize("raw", ["ture", "enable", "2", "y"])
def test_boolean_variables_reject_anything_else_naming_the_variable(monkeypatch, tmp_path, variable, raw):
    from kernels_core import KernelsPluginManager

    monkeypatch.setenv(variable, raw)
    message = (rf"environment variable {variable}='{raw}' is not a boolean; accepted \(any case\): 1, true, yes, on "
               r"/ 0, false, no, off, or empty for unset")
    with pytest.raises(ConfigError, match=message):
        load_config(None, cwd=tmp_path)
        KernelsPluginManager(load_entrypoints=False)


def test_plugin_switches_read_documented_booleans(monkeypatch):
    from kernels_core import KernelsPluginManager

    monkeypatch.setenv("KERNELS_CORE_STRICT_PLUGINS", "Yes")
    assert KernelsPluginManager(load_entrypoints=False).strict is True
    monkeypatch.setenv("KERNELS_CORE_STRICT_PLUGINS", "off")
    assert KernelsPluginManager(load_entrypoints=False).strict is False


# -- every key remembers its source ---------------------------------------------------------------------------------

def test_origins_name_the_layer_that_set_each_key(tmp_path, monkeypatch):
    (tmp_path / "kernels.toml").write_text('[kinds.rms_norm]\ndisable = ["a"]\nprefer = {cpu = ["b"]}\n')
    env_file = tmp_path / "env.toml"
    env_file.write_text('[kinds.rms_norm]\nprefer = {cuda = ["c"]}\n')
    monkeypatch.setenv("KERNELS_CORE_CONFIG", str(env_file))
    cfg = load_config({"kinds": {"rms_norm": {"disable": ["d"]}}}, cwd=tmp_path)
    assert cfg.origin("kinds", "rms_norm", "prefer", "cpu") == str(tmp_path / "kernels.toml")
    assert cfg.origin("kinds", "rms_norm", "prefer", "cuda") == f"KERNELS_CORE_CONFIG={env_file}"
    assert cfg.origin("kinds", "rms_norm", "disable") == "config argument"
    explicit = tmp_path / "explicit.toml"
    explicit.write_text("[plugins]\nblock = ['x']\n")
    assert load_config(str(explicit), cwd=tmp_path).origin("plugins", "block") == str(explicit)
