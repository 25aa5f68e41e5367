"""kernels-cuda and kernels-rocm installed together: each claims only its own torch build's ``cuda`` devices.

Both plugins see tensors of torch device type ``cuda``; which one drives them depends on the torch build. On a
simulated ROCm build every matched module must resolve to ``rocm.*`` (or portable ``any.*``) kernels and never
``cuda.*``, and the reverse on a simulated CUDA build. Run by the ``tests(vendor='rocm+cuda')`` nox session;
skipped where kernels-cuda is not installed (the ``tests(vendor='rocm')`` nox session holds only kernels-rocm).
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest


kernels_cuda = pytest.importorskip("kernels_cuda", reason="kernels-cuda is not installed in this environment")

from kernels_core import Mode  # noqa: E402 - imported after the importorskip above
from kernels_core import detect_devices  # noqa: E402
from kernels_core import get_report  # noqa: E402
from kernels_core import kernelize  # noqa: E402
from kernels_core.testing import fresh_plugin_manager  # noqa: E402
from kernels_core.testing import tiny_causal_lm  # noqa: E402
from kernels_rocm import _plugin as rocm_plugin  # noqa: E402
from rocm_testing import H100  # noqa: E402
from rocm_testing import MI300X  # noqa: E402
from rocm_testing import RX7900  # noqa: E402


FAMILIES = ["llama", "gemma", "qwen3_moe"]
# kernels-cuda's plugin module as kernels-core finds it, through its installed entry point: the module itself is
# private to kernels-cuda.
cuda_plugin = next(ep for ep in entry_points(group="kernels_core.plugins") if ep.name == "cuda").load()


@pytest.fixture(params=["rocm-first", "cuda-first"])
def pm(request):
    # Registration order must not matter: priority and detection are data.
    pairs = [(rocm_plugin, "rocm"), (cuda_plugin, "cuda")]
    return fresh_plugin_manager(*(pairs if request.param == "rocm-first" else pairs[::-1]))


def _kernels(family, pm, mode):
    model = kernelize(tiny_causal_lm(family), mode=mode, device="cuda", plugin_manager=pm)
    entries = get_report(model).entries
    assert entries, "the tiny model must match some layer kinds"
    return entries


def _chosen(entries):
    """The kernel chosen per module: the bound one, or the one whose module was left to torch.compile."""
    return [e.kernel or e.left_to_compiler for e in entries if e.kernel or e.left_to_compiler]


@pytest.mark.parametrize("mode", [Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_rocm_build_resolves_to_rocm_kernels_only(simulate, pm, family, mode):
    simulate("rocm", [MI300X, RX7900])
    backends = {b.backend: b for b in detect_devices(plugin_manager=pm)}
    assert set(backends) == {"rocm", "cpu"}
    assert [d.arch for d in backends["rocm"].devices] == ["gfx942", "gfx1100"]
    entries = _kernels(family, pm, mode)
    assert {e.backend for e in entries} == {"rocm"}
    chosen = _chosen(entries)
    assert all(k.startswith(("rocm.", "any.")) for k in chosen), chosen
    assert any(k.startswith("rocm.") for k in chosen), chosen


@pytest.mark.parametrize("mode", [Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_build_resolves_to_cuda_kernels_only(simulate, pm, family, mode):
    simulate("cuda", [H100])
    backends = {b.backend: b for b in detect_devices(plugin_manager=pm)}
    assert set(backends) == {"cuda", "cpu"}
    assert backends["cuda"].devices[0].capability == (9, 0)
    entries = _kernels(family, pm, mode)
    assert {e.backend for e in entries} == {"cuda"}
    chosen = _chosen(entries)
    assert all(k.startswith(("cuda.", "any.")) for k in chosen), chosen
    assert any(k.startswith("cuda.") for k in chosen), chosen


def _computed_by(family: str, pm) -> dict[str, str | None]:
    """``module:kind -> kernel`` that computes it: its own, or the enclosing module's kernel that covers it."""
    return {e.module + ":" + e.kind: e.kernel if e.applied else e.covered_by
            for e in _kernels(family, pm, Mode.TRAINING)}


def _vendor_kinds(pm, plugin: str) -> set[str]:
    return {p.spec.kind for p in pm.kernels() if p.plugin.name == plugin}


def test_same_model_gets_each_vendors_kernels_on_its_build(simulate, pm):
    simulate("rocm", [MI300X])
    rocm = _computed_by("llama", pm)
    pm.invalidate()  # detection is cached per manager; the simulated build changes next
    simulate("cuda", [H100])
    cuda = _computed_by("llama", pm)
    assert rocm.keys() == cuda.keys()
    assert None not in rocm.values() and None not in cuda.values(), (rocm, cuda)
    rocm_kinds, cuda_kinds = _vendor_kinds(pm, "rocm"), _vendor_kinds(pm, "cuda")
    vendor_modules = 0
    for key in rocm:
        kind = key.rsplit(":", 1)[1]
        # Never the other vendor's kernel on a build.
        assert not rocm[key].startswith("cuda.") and not cuda[key].startswith("rocm."), (key, rocm[key], cuda[key])
        if kind in rocm_kinds and kind in cuda_kinds:
            # A kind both vendors implement gets each vendor's own kernel on its build.
            assert rocm[key].startswith("rocm.") and cuda[key].startswith("cuda."), (key, rocm[key], cuda[key])
            vendor_modules += 1
        elif kind not in rocm_kinds | cuda_kinds:
            # A kind only the core implements (the causal mask) gets the same kernel on either build.
            assert rocm[key] == cuda[key], (key, rocm[key], cuda[key])
    assert vendor_modules, "the tiny llama must match kinds that both vendors implement"
    # Both wrap the same shared adapter for the loss; only the declaration differs.
    loss = [key for key in rocm if key.endswith(":causal_lm_loss")]
    assert loss and all(rocm[k].removeprefix("rocm.") == cuda[k].removeprefix("cuda.") for k in loss)


def test_cpu_build_claims_no_gpu(simulate, pm):
    simulate("cpu", [])
    assert [b.backend for b in detect_devices(plugin_manager=pm)] == ["cpu"]
