"""LLaMA-Factory v1 fixtures: a tiny chat model on disk (written once), LLaMA-Factory's argument parser."""

from __future__ import annotations

import pytest


pytest.importorskip("llamafactory", reason="LLaMA-Factory is not installed; nox -s \"tests(vendor='llamafactory')\" "
                                           "runs these tests in a venv of its own")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from kernels_core.integrations._llamafactory_tiny import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    from kernels_core.integrations._llamafactory_tiny import write_tiny_sft_dataset

    return write_tiny_sft_dataset(tmp_path_factory.mktemp("data") / "sft.jsonl", count=16)


@pytest.fixture
def use_pm():
    """Make ``pm`` the process-wide plugin manager (LLaMA-Factory's call path takes no manager argument)."""
    from kernels_core import reset_plugin_manager

    previous = []

    def install(pm):
        previous.append(reset_plugin_manager(pm))
        return pm

    yield install
    if previous:
        reset_plugin_manager(previous[0])
