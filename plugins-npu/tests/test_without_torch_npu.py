"""A host without torch_npu (or with a broken one): import torch, discovery and kernelize keep working.

These run in subprocesses whose import path does not contain the test emulation, i.e. a plain CPU host with
kernels-npu installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest


SCRIPT = textwrap.dedent(
    """
    import logging, sys
    import torch  # must still import: kernels-npu registers no torch device backend
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="LOG %(name)s %(message)s")
    for noisy in ("urllib3", "filelock", "httpx", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from kernels_core import KernelsPluginManager, KernelizeError, Mode, get_report, kernelize

    pm = KernelsPluginManager(allow=("npu",))
    print("PLUGINS", sorted((p.name, str(p.status)) for p in pm.plugins))
    npu = [b for b, _ in pm.backends() if b.backend == "npu"]
    print("NPU_DEVICES", [b.count for b in npu])
    if sys.argv[1] == "transformers":
        import transformers
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        model = transformers.LlamaForCausalLM(config)
        run = lambda: model(ids).logits
        ids = torch.randint(0, 64, (1, 5))
    else:  # transformers itself imports torch_npu when it finds one, and fails with it
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.RMSNorm(16, eps=1e-6))
        ids = torch.randn(3, 16)
        run = lambda: model(ids)
    expected = run()
    kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    chosen = sorted({e.kernel for e in get_report(model).entries if e.kernel})
    print("CHOSEN", chosen)
    print("SAME", torch.allclose(run(), expected, atol=1e-5))
    try:
        kernelize(model, mode=Mode.TRAINING, device="npu", plugin_manager=pm)
    except KernelizeError as exc:
        print("EXPLICIT_NPU_ERROR", exc)
    """
)


def _run(model_source, extra_path=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_NPU_EMULATION_DEVICES")}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    command = [sys.executable, "-c", SCRIPT, model_source]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _lines(out, prefix):
    return [line.removeprefix(prefix).strip() for line in out.splitlines() if line.startswith(prefix)]


def _check_no_npu(out, reason):
    (plugins,) = _lines(out, "PLUGINS")
    assert "('npu', 'loaded')" in plugins
    assert _lines(out, "NPU_DEVICES") == ["[0]"]
    assert not any(k.startswith("npu.") for k in eval(_lines(out, "CHOSEN")[0]))  # noqa: S307 - our own output
    assert _lines(out, "SAME") == ["True"]
    (error,) = _lines(out, "EXPLICIT_NPU_ERROR")
    assert "'npu' was requested, but no installed plugin detected it" in error
    # Why: kernels-npu's DEBUG log names the import failure.
    reasons = [line for line in out.splitlines() if line.startswith("LOG kernels_npu") and "no Ascend NPU" in line]
    assert reasons and reason in reasons[0], out


def test_host_without_torch_npu():
    out = _run("transformers")
    _check_no_npu(out, "No module named 'torch_npu'")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")', "libhccl.so"),
        ('raise RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda")',
         "Two accelerators"),
    ],
    ids=["without_cann", "two_accelerators"],
)
def test_host_with_a_torch_npu_that_cannot_import(tmp_path, body, reason):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(body + "\n")
    _check_no_npu(_run("torch", tmp_path), reason)


def test_distribution_never_pulls_torch_npu_nor_registers_a_torch_backend():
    dist = metadata.distribution("kernels-npu")
    requires = dist.requires or []
    npu_requirements = [r for r in requires if r.lower().replace("_", "-").startswith("torch-npu")]
    assert npu_requirements and all("extra == \"ascend\"" in r for r in npu_requirements), requires
    # torch auto-imports every `torch.backends` entry point at `import torch`; a broken one breaks torch.
    assert not [ep for ep in dist.entry_points if ep.group == "torch.backends"]
    assert Path(__file__).parent.joinpath("emulation", "torch_npu").is_dir()  # emulation lives in tests only
    assert not any("emulation" in str(f) for f in (dist.files or []))
