"""The kernels-core command line, as tables and as JSON."""

from __future__ import annotations

import json

import pytest
from kernels_core import _cli
from kernels_core import _manager
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
    assert "cpu:0" in capsys.readouterr().out


def test_kernels_filtered_by_backend(capsys):
    assert _cli.main(["kernels", "--backend", "cuda", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kernels"] and all(k["backend"] in ("cuda", "any") for k in data["kernels"])
    assert all("BACKWARD" in k["supports"] for k in data["kernels"])
    assert _cli.main(["kernels"]) == 0
    assert "any.causal_lm_loss.chunked" in capsys.readouterr().out


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(command in out for command in ("plugins", "devices", "kernels"))
