"""The kernels_core plugin through LLaMA-Factory v1's own model loading (ModelEngine) and SFT training."""

from __future__ import annotations

import dataclasses
import doctest
import json
import subprocess
import sys
import types
from pathlib import Path

import kernels_core
import kernels_core.integrations.llamafactory as lf_plugin
import pytest
import reference_plugin
import torch
from kernels_core import ConfigError
from kernels_core import KernelizeError
from kernels_core import KernelSpec
from kernels_core import hookimpl
from kernels_core.testing import assert_close
from kernels_core.testing import fresh_plugin_manager


def _args(model_dir, kernel_config=None, **extra):
    args = {"model": str(model_dir), "template": "chatml", **extra}
    if kernel_config is not None:
        args["kernel_config"] = kernel_config
    return args


def _engine(model_dir, kernel_config=None, *, is_train=True):
    """What LLaMA-Factory's run_sft / chat do: parse the arguments, then let ModelEngine load the model."""
    from llamafactory.v1.config import get_args
    from llamafactory.v1.core.model_engine import ModelEngine

    model_args, *_ = get_args(_args(model_dir, kernel_config))
    return ModelEngine(model_args, is_train=is_train)


def _batch(vocab_size):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab_size, (2, 23), generator=generator)
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


def _kernels(report):
    return {entry.kernel for entry in report.entries if entry.kernel}


def _unbound(model):
    """Modules carrying a per-instance forward or a binding record (what kernelize adds)."""
    return [name for name, module in model.named_modules()
            if "forward" in module.__dict__ or any(key.startswith("_kernels_core") for key in module.__dict__)]


def test_model_engine_kernelizes_through_the_registered_plugin(tiny_model_dir, ref_pm, use_pm, calls):
    use_pm(ref_pm)
    kernelized = _engine(tiny_model_dir, {"name": "kernels_core"}).model
    eager = _engine(tiny_model_dir).model
    report = kernels_core.get_report(kernelized)
    assert report is not None and report.mode == "TRAINING"  # ModelEngine(is_train=True) decides the mode
    assert {"ref.rms_norm", "ref.silu_gated_mlp", "ref.residual_rms_norm"} <= _kernels(report)
    assert kernels_core.get_report(eager) is None

    ids, labels = _batch(kernelized.config.vocab_size)
    kernelized.train(), eager.train()
    calls.clear()
    out_k = kernelized(input_ids=ids, labels=labels)
    out_e = eager(input_ids=ids, labels=labels)
    # LLaMA-Factory's trainers compute the loss from outputs.logits: the plugin keeps them by default.
    assert out_k.logits is not None
    assert calls["rms_norm"] > 0 and calls["silu_gated_mlp"] > 0
    assert_close(out_k.logits, out_e.logits, what="logits")
    assert_close(out_k.loss, out_e.loss, what="loss")
    out_k.loss.backward(), out_e.loss.backward()
    grads_e = dict(eager.named_parameters())
    for name, param in kernelized.named_parameters():
        assert_close(param.grad, grads_e[name].grad, what=f"grad {name}")


def test_kernel_config_options_reach_kernelize(tiny_model_dir, ref_pm, use_pm):
    use_pm(ref_pm)
    config = {"name": "kernels_core", "mode": "inference",
              "config": {"kinds": {"rms_norm": {"enabled": False}}}}
    report = kernels_core.get_report(_engine(tiny_model_dir, config).model)
    assert report.mode == "INFERENCE"
    # post_attention_layernorm is computed by the decoder layer's residual add + norm kernel (another kind).
    norms = [e for e in report.entries if e.kind == "rms_norm" and not e.covered]
    assert norms and all(e.kernel is None and "disabled" in e.reason for e in norms)
    assert "ref.silu_gated_mlp" in _kernels(report)
    # Without a mode, an engine that loads for inference (chat) kernelizes for inference.
    assert kernels_core.get_report(_engine(tiny_model_dir, {"name": "kernels_core"}, is_train=False).model
                                   ).mode == "INFERENCE"
    compiled = _engine(tiny_model_dir, {"name": "kernels_core", "mode": "training+torch_compile"}).model
    assert kernels_core.get_report(compiled).mode == "TRAINING|TORCH_COMPILE"


def test_include_kernels_selects_layer_kinds(tiny_model_dir, ref_pm, use_pm):
    use_pm(ref_pm)
    only_norms = _engine(tiny_model_dir, {"name": "kernels_core", "include_kernels": "rms_norm"}).model
    assert _kernels(kernels_core.get_report(only_norms)) == {"ref.rms_norm"}
    untouched = _engine(tiny_model_dir, {"name": "kernels_core", "include_kernels": False}).model
    assert kernels_core.get_report(untouched) is None and not _unbound(untouched)
    with pytest.raises(ConfigError, match=r"unknown layer kind 'rms_nrom' \(did you mean 'rms_norm'\?\)"):
        _engine(tiny_model_dir, {"name": "kernels_core", "include_kernels": "rms_nrom,silu_gated_mlp"})


@pytest.mark.parametrize(("key", "closest"), [("mdoe", "mode"), ("stricct", "strict"), ("configs", "config")])
def test_unknown_option_names_it_and_the_allowed_ones(tiny_model_dir, key, closest):
    with pytest.raises(ConfigError) as info:
        _engine(tiny_model_dir, {"name": "kernels_core", key: "x"})
    message = str(info.value)
    assert f"unknown option {key!r} (did you mean {closest!r}?)" in message
    assert "allowed: name, include_kernels, mode, strict, device, config" in message


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("mode", "trainig", r"unknown mode 'trainig' \(did you mean 'training'\?\)"),
    ("mode", "training+inference", "mutually exclusive"),
    ("strict", "sometimes", "kernel_config.strict: expected true or false"),
    ("config", {"kinds": {"rms_norm": {"enabeld": False}}}, r"unknown key\(s\) \['enabeld'\]"),
])
def test_malformed_values_are_named(tiny_model_dir, option, value, expected):
    with pytest.raises(ConfigError, match=expected):
        _engine(tiny_model_dir, {"name": "kernels_core", option: value})


def _flaky_plugin():
    """The reference kernels under another name, with a binder that fails on the third module."""
    seen = []

    def kernels_core_bind_kernel(module, match, kernel, forward):
        seen.append(kernel.id)
        if len(seen) == 3:
            raise RuntimeError("cannot bind the third module")
        return None

    plugin = types.ModuleType("flaky_plugin")
    specs = [dataclasses.replace(spec, id=spec.id.replace("ref.", "flaky."), priority=90)
             for spec in reference_plugin.SPECS]
    plugin.kernels_core_kernels = hookimpl(lambda: specs)
    plugin.kernels_core_bind_kernel = hookimpl(kernels_core_bind_kernel)
    return plugin, seen


def test_failed_kernelize_leaves_the_loaded_model_untouched(tiny_model_dir, use_pm, monkeypatch):
    from transformers import AutoModelForCausalLM

    plugin, seen = _flaky_plugin()
    use_pm(fresh_plugin_manager((reference_plugin, "reference"), (plugin, "flaky")))
    loaded = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        loaded.append(original(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    with pytest.raises(KernelizeError, match="cannot bind the third module") as info:
        _engine(tiny_model_dir, {"name": "kernels_core"})
    assert any("the model was not changed" in note for note in getattr(info.value, "__notes__", ()))
    assert len(seen) == 3  # two modules were bound before the failure, then rolled back
    model = loaded[0]
    assert kernels_core.get_report(model) is None and not _unbound(model)
    eager = _engine(tiny_model_dir).model
    ids, labels = _batch(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, eager(input_ids=ids).logits)


def test_strict_through_model_engine(tiny_model_dir, use_pm):
    # The portable kernels have no CPU rotary kernel: nothing could be used there, so strict is met.
    use_pm(fresh_plugin_manager())
    report = kernels_core.get_report(_engine(tiny_model_dir, {"name": "kernels_core", "strict": True}).model)
    assert any(e.kind == "rotary_embedding" and "no kernel for backend cpu" in e.reason for e in report.entries)
    # A CPU rotary kernel that exists but cannot be used (its requirement is missing) is unmet: strict raises.
    plugin = types.ModuleType("plugin_rotary")
    plugin.kernels_core_kernels = hookimpl(lambda: [KernelSpec(
        id="cpu.rotary_embedding.test", kind="rotary_embedding", variants=("full",), backend="cpu",
        impl="kernels_core.portable:rms_norm", requires=("kernels-core-no-such-package>=1",))])
    use_pm(fresh_plugin_manager((plugin, "rotary")))
    with pytest.raises(KernelizeError, match=r"strict kernelize: .*rotary_embedding.*requirement missing"):
        _engine(tiny_model_dir, {"name": "kernels_core", "strict": True})


def _sft(model_dir, dataset, kernel_config, output_dir):
    """LLaMA-Factory v1's run_sft, keeping the trainer to read its log history."""
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config import get_args
    from llamafactory.v1.core.data_engine import DataEngine
    from llamafactory.v1.core.model_engine import ModelEngine
    from llamafactory.v1.trainers.sft_trainer import SFTTrainer

    model_args, data_args, training_args, _ = get_args(_args(
        model_dir, kernel_config, train_dataset=str(dataset), output_dir=str(output_dir), micro_batch_size=4,
        global_batch_size=8, cutoff_len=64, learning_rate=1e-3, max_steps=3, batching_workers=0, seed=0))
    DistributedInterface(training_args.dist_config)
    engine = ModelEngine(model_args, is_train=True)
    trainer = SFTTrainer(args=training_args, model=engine.model, renderer=engine.renderer,
                         train_dataset=DataEngine(data_args.train_dataset))
    trainer.fit()
    return [entry["loss"] for entry in trainer.state.log_history], engine.model


# LLaMA-Factory's batching uses torchdata 0.11's StatefulDataLoader, which on torch 2.13's CPU build warns about
# torch.set_vital and pin_memory_device (deprecated) and pinned memory without an accelerator.
@pytest.mark.filterwarnings("ignore::UserWarning:torchdata")
@pytest.mark.filterwarnings("ignore::UserWarning:torch.utils.data")
def test_sft_training_matches_eager(tiny_model_dir, tiny_dataset, ref_pm, use_pm, calls, tmp_path):
    use_pm(ref_pm)
    calls.clear()
    losses, model = _sft(tiny_model_dir, tiny_dataset, {"name": "kernels_core"}, tmp_path / "kernels")
    assert calls["rms_norm"] > 0 and calls["silu_gated_mlp"] > 0 and calls["residual_rms_norm"] > 0
    assert kernels_core.get_report(model).mode == "TRAINING"
    eager_losses, _ = _sft(tiny_model_dir, tiny_dataset, None, tmp_path / "eager")
    assert len(losses) == len(eager_losses) == 3
    # Activation checkpointing (LLaMA-Factory's default) re-runs the kernels in backward; fp32 rounding only.
    for kernel, eager in zip(losses, eager_losses, strict=True):
        assert abs(kernel - eager) <= 1e-5 * abs(eager), (losses, eager_losses)


def _cli(module, config_path, model_dir, dataset, output_dir, *overrides):
    return subprocess.run(
        [sys.executable, "-m", module, "sft", str(config_path), f"model={model_dir}", f"train_dataset={dataset}",
         f"output_dir={output_dir}", *overrides],
        capture_output=True, text=True, timeout=600,
    )


def _losses(output_dir):
    return [json.loads(line)["loss"] for line in (Path(output_dir) / "trainer_log.jsonl").read_text().splitlines()]


def test_command_line_runner(tiny_model_dir, tiny_dataset, tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text("template: chatml\nkernel_config:\n  name: kernels_core\nmicro_batch_size: 4\n"
                      "global_batch_size: 8\ncutoff_len: 64\nlearning_rate: 1.0e-3\nmax_steps: 2\n"
                      "batching_workers: 0\nseed: 0\n")
    # The plugin is reached: a misspelt option under kernel_config stops the run with the plugin's message.
    bad = _cli("kernels_core.integrations.llamafactory", config, tiny_model_dir, tiny_dataset, tmp_path / "bad",
               "kernel_config.mdoe=training")
    assert bad.returncode != 0 and "unknown option 'mdoe' (did you mean 'mode'?)" in bad.stderr, bad.stderr[-3000:]
    run = _cli("kernels_core.integrations.llamafactory", config, tiny_model_dir, tiny_dataset, tmp_path / "k")
    assert run.returncode == 0, run.stderr[-3000:]
    # Losses against eager are compared in-process above; here: the run trained and saved through LF's CLI steps.
    losses = _losses(tmp_path / "k")
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses), losses
    assert (tmp_path / "k" / "config.json").is_file()


def _python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_importing_kernels_core_does_not_import_llamafactory():
    run = _python("import kernels_core, kernels_core.integrations, sys; kernels_core.list_plugins(); "
                  "print(sorted(m for m in sys.modules if m.split('.')[0] == 'llamafactory'))")
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def test_missing_llamafactory_is_named():
    run = _python("import sys; sys.modules['llamafactory'] = None\n"
                  "try:\n    import kernels_core.integrations.llamafactory\n"
                  "except ModuleNotFoundError as exc:\n    print(exc.name, '|', exc)\n")
    assert run.returncode == 0, run.stderr
    name, message = run.stdout.split("|", 1)
    assert name.strip() == "llamafactory"
    assert "needs LLaMA-Factory 0.9.5" in message and "pip install 'kernels-core[llamafactory]'" in message


def test_registration_and_docstring_examples():
    from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin

    assert KernelPlugin("kernels_core")["__call__"] is lf_plugin.kernelize_for_llamafactory
    lf_plugin.register()  # again: still the same callable, registered once
    assert KernelPlugin("kernels_core")["__call__"] is lf_plugin.kernelize_for_llamafactory
    from kernels_core.integrations import _llamafactory

    for module in (lf_plugin, _llamafactory):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0 and result.failed == 0, module.__name__
