"""The ``fp8`` shorthand of ``KernelizeCallback`` and of the LLaMA-Factory plugin: what it asks kernelize for.

Stand-in kernels named like kernels-cuda's (``<backend>.linear.float8_<recipe>``) make the request visible on the
CPU: ``cpu.linear.float8_rowwise`` is ``F.linear`` itself, ``cuda.linear.float8_rowwise`` runs only on a GPU.
"""

from __future__ import annotations

import types

import kernels_core
import pytest
import torch
from kernels_core import ConfigError
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import Mode
from kernels_core import Supports
from kernels_core import hookimpl
from kernels_core.testing import fresh_plugin_manager
from kernels_core.testing import tiny_causal_lm


transformers = pytest.importorskip("transformers")
from kernels_core.integrations._llamafactory import kernelize_for_llamafactory  # noqa: E402
from kernels_core.integrations.transformers import KernelizeCallback  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers import TrainingArguments  # noqa: E402


COMPILED = Mode.TRAINING | Mode.TORCH_COMPILE
SIZES = {"hidden_size": 48, "intermediate_size": 80, "head_dim": 12}


def stand_in_linear(input, weight, bias=None):
    return torch.nn.functional.linear(input, weight, bias)


def _pm(*backends):
    specs = [KernelSpec(id=f"{backend}.linear.float8_{recipe}", kind="linear", variants=("projection", "head"),
                        backend=backend, impl=f"{__name__}:stand_in_linear", dtypes=("bfloat16",),
                        supports=Supports.BACKWARD | Supports.TORCH_COMPILE, compile_only=True)
             for backend in backends for recipe in ("rowwise", "tensorwise")]
    plugin = types.ModuleType("fp8_stand_in")
    plugin.kernels_core_kernels = hookimpl(lambda: specs)
    return fresh_plugin_manager((plugin, "fp8_stand_in"))


def _model():
    return tiny_causal_lm("llama", dtype=torch.bfloat16, **SIZES)


def _linear_kernels(model):
    return {e.kernel for e in kernels_core.get_report(model).entries if e.kind == "linear" and e.kernel}


def _trainer(tmp_path, callback, model):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, save_strategy="no",
                             per_device_train_batch_size=2, max_steps=1)
    return Trainer(model=model, args=args, callbacks=[callback])


def test_unknown_recipe_is_named_with_the_closest():
    with pytest.raises(ConfigError, match=r"unknown FP8 recipe 'rowise' \(did you mean 'rowwise'\?\)"):
        KernelizeCallback(fp8="rowise")
    with pytest.raises(ConfigError, match="kernel_config.fp8: unknown FP8 recipe 'e4m3'"):
        kernelize_for_llamafactory(_model(), fp8="e4m3")


def test_callback_asks_for_the_recipe_kernels(tmp_path):
    callback = KernelizeCallback(mode=COMPILED, fp8="tensorwise", plugin_manager=_pm("cpu"))
    assert repr(callback).endswith("strict=False, fp8='tensorwise')")
    model = _model()
    _trainer(tmp_path, callback, model)
    assert _linear_kernels(model) == {"cpu.linear.float8_tensorwise"}
    report = kernels_core.get_report(model)
    assert {e.note for e in report.entries if e.kernel == "cpu.linear.float8_tensorwise"} == {"preferred by config"}


def test_without_fp8_the_callback_leaves_linears_alone(tmp_path):
    model = _model()
    _trainer(tmp_path, KernelizeCallback(mode=COMPILED, plugin_manager=_pm("cpu")), model)
    assert not any(e.kind == "linear" for e in kernels_core.get_report(model).entries)


def test_callback_request_that_cannot_be_honoured_stops_training(tmp_path):
    model = _model()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with pytest.raises(KernelizeError, match="cuda.linear.float8_rowwise: runs on backend cuda, module is on cpu"):
        _trainer(tmp_path, KernelizeCallback(mode=COMPILED, fp8="rowwise", plugin_manager=_pm("cuda")), model)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before
    with pytest.raises(KernelizeError, match="runs only under torch.compile"):
        _trainer(tmp_path, KernelizeCallback(fp8="rowwise", plugin_manager=_pm("cpu")), _model())
    with pytest.raises(ConfigError, match=r"no installed plugin declares an FP8 linear kernel \(\*.linear.float8_"):
        _trainer(tmp_path, KernelizeCallback(mode=COMPILED, fp8="rowwise", plugin_manager=_pm()), _model())


def test_callback_refuses_two_requests_for_the_linear_kernels(tmp_path):
    config = {"kinds": {"linear": {"prefer": {"cpu": ["cpu.linear.float8_rowwise"]}}}}
    callback = KernelizeCallback(mode=COMPILED, fp8="tensorwise", config=config, plugin_manager=_pm("cpu"))
    with pytest.raises(ConfigError, match="both the fp8 shorthand and \\[kinds.linear\\] prefer"):
        _trainer(tmp_path, callback, _model())


@pytest.fixture
def process_pm():
    """A stand-in manager as the process-wide one (the LLaMA-Factory plugin takes no manager argument)."""
    previous = kernels_core.reset_plugin_manager(_pm("cpu"))
    yield
    kernels_core.reset_plugin_manager(previous)


def test_llamafactory_option(process_pm):
    model = kernelize_for_llamafactory(_model(), mode="training+torch_compile", fp8="rowwise")
    assert _linear_kernels(model) == {"cpu.linear.float8_rowwise"}
    # The plugin's own default (the loss keeps its logits) still holds beside the request.
    loss = next(e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss")
    assert loss.kernel is not None
    with pytest.raises(KernelizeError, match="runs only under torch.compile"):
        kernelize_for_llamafactory(_model(), mode="training", fp8="rowwise")
