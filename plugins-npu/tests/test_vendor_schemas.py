"""kernels-npu's torch_npu calls and the test emulation, against the schemas of real torch_npu releases.

The wheels of the oldest and the newest supported release (``vendor_schemas.OLDEST`` / ``NEWEST``) are downloaded
from the package index into a cache (``$KERNELS_NPU_WHEEL_CACHE``, else ``~/.cache/kernels-npu-tests``; about
30 and 45 MB) and read as zip files, never installed. Without the package index those tests skip, saying why.
The tests of the checker itself (at the bottom) need no download.
"""

from __future__ import annotations

import re
import textwrap
import zipfile
from pathlib import Path

import kernels_npu
import pytest
import torch
import torch_npu  # the emulation (tests/conftest.py puts it first on the path)
import vendor_schemas as vs


PACKAGE = Path(kernels_npu.__file__).parent
PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
EMULATED_OPERATORS = sorted(name for name in torch_npu.__all__ if name.startswith("npu_"))
# Emulation-only controls of the device module, which torch_npu does not have.
EMULATION_ONLY = {"set_emulated_devices"}
EMULATED_DEVICE_FUNCTIONS = sorted(set(torch_npu.npu.__all__) - EMULATION_ONLY)


@pytest.fixture(scope="module")
def releases() -> dict[str, vs.Release]:
    found = {}
    for version in (vs.OLDEST, vs.NEWEST):
        try:
            wheel = vs.download_wheel(version)
        except vs.WheelUnavailable as exc:
            pytest.skip(f"torch_npu wheels not available, vendor schemas not checked: {exc}")
        found[version] = vs.read_release(wheel, version)
    return found


def _plugin_calls() -> tuple[list[vs.CallSite], list[vs.CallSite], list[str]]:
    return vs.collect_call_sites(PACKAGE.rglob("*.py"), root=PACKAGE.parent)


# ---------------------------------------------------------------------------------------------------------------
# Against the releases


@pytest.mark.parametrize("version", [vs.OLDEST, vs.NEWEST])
def test_every_operator_call_of_the_plugin_binds_to_the_release_schema(releases, version):
    operators, _, _ = _plugin_calls()
    release = releases[version]
    errors = []
    for site in operators:
        try:
            errors += vs.check_call(site, release.operator(site.function))
        except KeyError as exc:
            errors.append(f"{site.where}: {exc.args[0]}")
    assert not errors, "\n".join(errors)
    # Where the schemas were found (all of them in npu_native_functions_by_codegen.yaml so far).
    assert {release.schemas[name][0][1] for name in EMULATED_OPERATORS} <= set(release.schema_files)


@pytest.mark.parametrize("version", [vs.OLDEST, vs.NEWEST])
def test_every_device_call_of_the_plugin_binds_to_the_release(releases, version):
    _, devices, _ = _plugin_calls()
    assert devices, "no torch.npu call found in kernels_npu: the walk no longer sees detection's calls"
    errors = []
    for site in devices:
        errors += vs.check_call(site, releases[version].device_functions[site.function])
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", EMULATED_OPERATORS)
def test_emulated_operator_has_the_schema_both_releases_share(releases, name):
    common = vs.common_signature(releases[vs.OLDEST].operator(name), releases[vs.NEWEST].operator(name))
    errors = vs.check_emulated(getattr(torch_npu, name), common)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", EMULATED_DEVICE_FUNCTIONS)
def test_emulated_device_function_has_the_signature_of_both_releases(releases, name):
    oldest, newest = (releases[v].device_functions[name] for v in (vs.OLDEST, vs.NEWEST))
    errors = vs.check_emulated(getattr(torch_npu.npu, name), vs.common_signature(oldest, newest))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("version", [vs.OLDEST, vs.NEWEST])
def test_release_has_the_k_axis_grouped_matmul_the_experts_backward_uses(releases, version):
    """The weight gradient of the experts calls npu_grouped_matmul with group_type=2 (k-axis grouping), which the
    schema cannot show: the operator's compiled library says which group types its eager path takes."""
    with zipfile.ZipFile(releases[version].wheel) as archive:
        library = archive.read("torch_npu/lib/libtorch_npu.so")
    assert b"group_type currently only support -1 and 0" not in library
    assert b"K_SPLIT" in library


# ---------------------------------------------------------------------------------------------------------------
# Without a download


def test_plugin_calls_exactly_the_emulated_operators_and_only_directly():
    operators, _, problems = _plugin_calls()
    assert not problems, "\n".join(problems)
    assert sorted({site.function for site in operators}) == EMULATED_OPERATORS


def test_ascend_extra_declares_the_oldest_checked_release():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert extras["ascend"] == [f"torch-npu>={vs.OLDEST}"]
    assert any(re.match(r"pyyaml\b", requirement, re.IGNORECASE) for requirement in extras["test"])


SCHEMA = vs.parse_schema(
    "npu_op(Tensor self, Tensor gamma, float eps=1e-06, str mode='half', *, Tensor[]? extra=None, int? kind=0) "
    "-> (Tensor, Tensor)", source="test")


def _sites(source: str, tmp_path: Path) -> tuple[list[vs.CallSite], list[vs.CallSite], list[str]]:
    (tmp_path / "mod.py").write_text(textwrap.dedent(source))
    return vs.collect_call_sites([tmp_path / "mod.py"], root=tmp_path)


def _errors(call: str, tmp_path: Path) -> str:
    (site,), _, _ = _sites(f"MODE = 'half'\nx = {call}", tmp_path)
    return "\n".join(vs.check_call(site, SCHEMA))


@pytest.mark.parametrize(("call", "expected"), [
    ("npu.npu_op(a, b)[0]", ""),
    ("npu.npu_op(a, b, 1e-5, MODE, kind=1)[1]", ""),
    ("npu.npu_op(a, b, extra=[a], kind=None)[0]", ""),
    ("npu.npu_op(a, b, epsilon=1e-5)[0]", "no parameter named 'epsilon'"),
    ("npu.npu_op(a, b, 1e-5, 'half', [a])[0]", "5 positional arguments"),
    ("npu.npu_op(a, eps=1e-5)[0]", "required arguments not passed: ['gamma']"),
    ("npu.npu_op(a, b, gamma=b)[0]", "'gamma' given positionally and by keyword"),
    ("npu.npu_op(a, b, mode=1)[0]", "mode gets a int literal"),
    ("npu.npu_op(a, b, eps='x')[0]", "eps gets a str literal"),
    ("npu.npu_op(a, b, kind=True)[0]", "kind gets a bool literal"),
    ("npu.npu_op(a, b, extra=a.sum())[0]", ""),  # not a literal: its type is not known statically
    ("npu.npu_op(a, b, extra=1)[0]", "extra gets a int literal"),
    ("npu.npu_op([a], b)[0]", "self gets a list literal"),
    ("npu.npu_op(a, b)[2]", "result indexed [2]"),
    ("npu.npu_op(a, b)", "the 2-tuple result is kept whole"),
    ("npu.npu_op(*args)[0]", "passes *args or **kwargs"),
])
def test_check_call_flags_each_way_a_call_can_miss_the_schema(tmp_path, call, expected):
    errors = _errors(call, tmp_path)
    if expected:
        assert expected in errors
    else:
        assert errors == ""


def test_check_call_checks_unpacking_and_single_results(tmp_path):
    (good, bad), _, _ = _sites("y, r = npu.npu_op(a, b)\ny, r, s = npu.npu_op(a, b)\n", tmp_path)
    assert vs.check_call(good, SCHEMA) == []
    assert "unpacked into 3" in "\n".join(vs.check_call(bad, SCHEMA))
    single = vs.parse_schema("npu_one(Tensor self) -> Tensor", source="test")
    (whole, indexed), _, _ = _sites("y = npu.npu_one(a)\nz = npu.npu_one(a)[0]\n", tmp_path)
    assert vs.check_call(whole, single) == []
    assert "result indexed [0]" in "\n".join(vs.check_call(indexed, single))
    listing = vs.parse_schema("npu_many(Tensor[] x) -> Tensor[]", source="test")
    (listed,), _, _ = _sites("y = npu.npu_many([a])[0]\n", tmp_path)
    assert vs.check_call(listed, listing) == []


def test_collect_reports_uses_it_cannot_check(tmp_path):
    operators, devices, problems = _sites("""
        from torch_npu import npu_rms_norm
        fn = torch_npu.npu_swiglu
        other = getattr(torch_npu, "npu_rotary_mul")
        npu.is_available(); torch.cuda.is_available(); torch.npu.device_count()
    """, tmp_path)
    text = "\n".join(problems)
    assert "from torch_npu import" in text and "npu_swiglu used without being called" in text
    assert "getattr(..., 'npu_rotary_mul')" in text
    assert operators == [] and [site.function for site in devices] == ["is_available", "device_count"]


def test_common_signature_keeps_only_what_both_releases_accept():
    old = vs.parse_schema("op(Tensor self, int a=0, *, int? k=None, ScalarType? t=None) -> Tensor", source="old")
    new = vs.parse_schema("op(Tensor self, int a=0, int b=1, *, int? k=None, int? t=None, int? n=None) -> Tensor",
                          source="new")
    common = vs.common_signature(old, new)
    assert [(p.name, p.keyword_only) for p in common.params] == [("self", False), ("a", False), ("k", True),
                                                                 ("t", True)]
    assert common.params[3].types == frozenset({"ScalarType?", "int?"})
    with pytest.raises(ValueError, match="return types differ"):
        vs.common_signature(old, vs.parse_schema("op(Tensor self) -> (Tensor, Tensor)", source="other"))
    with pytest.raises(ValueError, match="required only in one release"):
        vs.common_signature(old, vs.parse_schema("op(Tensor self, int z) -> Tensor", source="other"))


REFERENCE = vs.parse_schema("op(Tensor self, float eps=1e-06, *, Tensor[]? extra=None) -> (Tensor, int)",
                            source="test")


def _reference(self: torch.Tensor, eps: float = 1e-06, *, extra: list[torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, int]: ...


def _renamed(self: torch.Tensor, epsilon: float = 1e-06, *, extra: list[torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, int]: ...


def _default(self: torch.Tensor, eps: float = 1e-05, *, extra: list[torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, int]: ...


def _positional(self: torch.Tensor, eps: float = 1e-06, extra: list[torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, int]: ...


def _extra(self: torch.Tensor, eps: float = 1e-06, *, extra: list[torch.Tensor] | None = None,
           more: int = 0) -> tuple[torch.Tensor, int]: ...


def _typed(self: torch.Tensor, eps: int = 1e-06, *, extra: list[torch.Tensor] | None = None,
           ) -> tuple[torch.Tensor, int]: ...


def _returns(self: torch.Tensor, eps: float = 1e-06, *, extra: list[torch.Tensor] | None = None,
             ) -> torch.Tensor: ...


@pytest.mark.parametrize(("function", "expected"), [
    (_reference, ""),
    (_renamed, "parameters ['self', 'epsilon', 'extra'], expected ['self', 'eps', 'extra']"),
    (_default, "eps defaults to 1e-05, expected 1e-06"),
    (_positional, "extra is positional, expected keyword-only"),
    (_extra, "parameters ['self', 'eps', 'extra', 'more']"),
    (_typed, "eps is annotated <class 'int'>"),
    (_returns, "returns <class 'torch.Tensor'>, expected tuple[torch.Tensor, int]"),
])
def test_check_emulated_flags_each_signature_change(function, expected):
    errors = "\n".join(vs.check_emulated(function, REFERENCE))
    if expected:
        assert expected in errors
    else:
        assert errors == ""

