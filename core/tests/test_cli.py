"""The kernels-core command line, as tables and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import kernels_core
import pytest
from kernels_core import BackendInfo
from kernels_core import KernelSpec
from kernels_core import _cli
from kernels_core import hookimpl
from kernels_core._check import check
from kernels_core._plugins import _manager
from kernels_core.testing import fresh_plugin_manager


@pytest.fixture(autouse=True)
def _isolated_manager():
    previous = _manager.reset_plugin_manager(fresh_plugin_manager())
    yield
    _manager.reset_plugin_manager(previous)


def test_plugins_table_and_json(capsys):
    assert _cli.main(["plugins"]) == 0
    table = capsys.readouterr().out
    assert "builtin" in table and "loaded" in table
    assert _cli.main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {p["name"] for p in data["plugins"]} == {"builtin", "portable"}


def test_devices_lists_the_host_cpu(capsys):
    assert _cli.main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cpu = [b for b in data["backends"] if b["backend"] == "cpu"]
    assert cpu and cpu[0]["count"] == 1 and cpu[0]["plugin"] == "builtin"
    assert _cli.main(["devices"]) == 0
    # Named as kernelize reports name the device of a CPU module: `cpu`, not `cpu:0`.
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows[0][:3] == ["cpu", "cpu", "0"]


def test_kernels_filtered_by_backend(capsys):
    assert _cli.main(["kernels", "--backend", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kernels"] and all(k["backend"] in ("cpu", "any") for k in data["kernels"])
    assert any(k["backend"] == "cpu" for k in data["kernels"])
    assert all("BACKWARD" in k["supports"] for k in data["kernels"])
    assert _cli.main(["kernels"]) == 0
    assert "any.causal_lm_loss.chunked" in capsys.readouterr().out


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(command in out for command in ("plugins", "devices", "kinds", "kernels", "check", "--version"))


def test_unknown_backend_is_rejected_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["kernels", "--backend", "cpux"])
    assert exit_info.value.code == 2
    assert "unknown backend 'cpux' (did you mean 'cpu'?); known backends: any, cpu" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kernels-core {kernels_core.__version__}"


def test_python_dash_m_runs_the_same_command_line():
    result = subprocess.run([sys.executable, "-m", "kernels_core", "--version"], capture_output=True, text=True,
                            check=False)
    assert (result.returncode, result.stdout.strip()) == (0, f"kernels-core {kernels_core.__version__}")
    result = subprocess.run([sys.executable, "-m", "kernels_core", "kinds", "--json"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0 and "rms_norm" in {k["name"] for k in json.loads(result.stdout)["kinds"]}


def test_kinds_table_and_json(capsys):
    assert _cli.main(["kinds"]) == 0
    table = capsys.readouterr().out
    header, _, *rows = table.splitlines()
    assert header.split()[:5] == ["kind", "variants", "target", "options", "plugin"]
    by_name = {row.split()[0]: row.split() for row in rows}
    assert by_name["rotary_embedding"][1:3] == ["full,partial,interleaved", "global"]
    assert by_name["causal_lm_loss"][3:5] == ["materialize_logits", "builtin"]
    assert _cli.main(["kinds", "--json"]) == 0
    kinds = {k["name"]: k for k in json.loads(capsys.readouterr().out)["kinds"]}
    assert kinds["causal_lm_loss"]["options"] == {"materialize_logits": ["bool"]}
    assert kinds["rms_norm"]["variants"] == ["standard", "offset"] and kinds["rms_norm"]["plugin"] == "builtin"


def _elsewhere_plugin():
    plugin = types.ModuleType("plugin_elsewhere")
    specs = [
        KernelSpec(id="acme.rms_norm.k", kind="rms_norm", variants=("standard",), backend="acme",
                   impl="kernels_core.portable:rms_norm"),
        KernelSpec(id="needs.rms_norm.k", kind="rms_norm", variants=("standard",), backend="any",
                   impl="kernels_core.portable:rms_norm", priority=-2,
                   requires=("kernels-core-no-such-package>=1",)),
        KernelSpec(id="fine.rms_norm.k", kind="rms_norm", variants=("standard",), backend="any",
                   impl="kernels_core.portable:rms_norm", priority=-1),
    ]
    plugin.kernels_core_kernels = hookimpl(lambda: specs)
    # The plugin that drives the backend is installed, but finds no device here.
    plugin.kernels_core_detect_devices = hookimpl(
        lambda: [BackendInfo("acme", "acme", devices=(), reason="acme driver not loaded")])
    return plugin


def test_kernels_says_which_kernels_cannot_run_here_as_check_decides(capsys):
    pm = fresh_plugin_manager((_elsewhere_plugin(), "elsewhere"))
    _manager.reset_plugin_manager(pm)  # the autouse fixture restores the previous manager
    assert _cli.main(["kernels"]) == 0
    out = capsys.readouterr().out
    status = {line.split()[0]: line.split(maxsplit=8)[-1].strip() for line in out.splitlines()
              if line.startswith(("acme.", "needs.", "fine."))}
    assert status == {"acme.rms_norm.k": "cannot run here", "needs.rms_norm.k": "cannot run here",
                      "fine.rms_norm.k": "ok"}
    assert ("cannot run here: acme.rms_norm.k (elsewhere): no acme device detected (acme driver not loaded)"
            in out)
    assert ("cannot run here: needs.rms_norm.k (elsewhere): requirement missing: kernels-core-no-such-package is "
            "not installed") in out
    assert _cli.main(["kernels", "--json"]) == 0
    problems = {k["id"]: k["problems"] for k in json.loads(capsys.readouterr().out)["kernels"]}
    assert problems["fine.rms_norm.k"] == []
    # The same reasons the conformance check skips them for.
    skipped = {r.kernel: r.reason for r in check(["elsewhere"], plugin_manager=pm, compile=False).results
               if r.status == "skipped"}
    for kernel in ("acme.rms_norm.k", "needs.rms_norm.k"):
        assert [p["detail"] for p in problems[kernel] if p["status"] == "cannot run here"] == [skipped[kernel]]
