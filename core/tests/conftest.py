"""Fixtures: every test gets a fresh plugin manager; nothing depends on what else is installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernels_core import reset_plugin_manager
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import isolate_environment


sys.path.insert(0, str(Path(__file__).parent))

import reference_plugin  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    isolate_environment(monkeypatch, tmp_path)


@pytest.fixture
def pm():
    """Built-in plugin and portable kernels only."""
    return fresh_plugin_manager()


@pytest.fixture
def ref_pm():
    """Built-in plugin, portable kernels and the reference plugin (priority 50, every kind)."""
    reference_plugin.CALLS.clear()
    return fresh_plugin_manager((reference_plugin, "reference"))


@pytest.fixture
def ref_installed(ref_pm):
    """``ref_pm`` as the process-wide plugin manager: the installed plugins a loaded model finds its kernels in."""
    previous = reset_plugin_manager(ref_pm)
    yield ref_pm
    reset_plugin_manager(previous)


@pytest.fixture
def calls():
    return reference_plugin.CALLS


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The query length of every causal SDPA call made without a mask, in call order: a packed-attention kernel
    computing documents one by one makes one per document (one for documents all of one length); transformers'
    sdpa over a packed row's dense mask makes none, and over an unmasked row one of the row's length."""
    lengths: list[int] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        if kwargs.get("is_causal") and kwargs.get("attn_mask") is None:
            lengths.append(query.shape[-2])
        return original(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return lengths
