"""The example plugin, installed as a real distribution, extends kernels-core end to end."""

from __future__ import annotations

import kernels_core
import pytest
import torch
from kernels_core import KernelsPluginManager
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import assert_conforms
from kernels_core.testing import tiny_causal_lm


def test_discovered_through_its_entry_point():
    pm = KernelsPluginManager(allow=["example", "portable"])
    info = pm.info("example")
    assert (info.status, info.distribution) == ("loaded", "kernels-example-plugin")
    assert "plain_mlp" in pm.layer_kinds()
    assert [p.spec.id for p in pm.kernels() if p.spec.kind == "plain_mlp"] == ["example.plain_mlp.recompute"]


@pytest.mark.parametrize("family", ["starcoder2", "phi"])
def test_new_kind_matches_and_reproduces_eager(family):
    pm = KernelsPluginManager(allow=["example", "portable"])
    model = tiny_causal_lm(family)
    ids = torch.randint(3, 100, (2, 9))
    model.train()
    eager = model(input_ids=ids, labels=ids)
    eager.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    rows = [e for e in kernels_core.get_report(model).entries if e.kind == "plain_mlp"]
    assert len(rows) == 2 and all(e.kernel == "example.plain_mlp.recompute" for e in rows)
    assert all(e.distribution == "kernels-example-plugin" for e in rows)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert_close(out.loss, eager.loss)
    for name, param in model.named_parameters():
        assert_close(param.grad, grads[name], factor=2.0, what=name)


def test_every_kernel_conforms():
    """Forward, backward, every declared dtype and torch.compile, against Starcoder2's and GPT-NeoX's MLPs."""
    report = assert_conforms("example")
    assert {r.status for r in report.results} == {"pass"}
