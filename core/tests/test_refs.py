"""Lazy references: loading them, and finding what is wrong with one without running plugin code."""

from __future__ import annotations

import sys

from kernels_core._refs import load_ref
from kernels_core._refs import locate_problem
from kernels_core._refs import ref_problem


def double(x):
    return x * 2


def test_a_reference_loads_the_attribute_through_its_dotted_path():
    assert load_ref(f"{__name__}:double") is double
    assert load_ref("json.decoder:JSONDecoder.decode") is sys.modules["json.decoder"].JSONDecoder.decode


def test_ref_problems_are_found_and_located_without_importing(tmp_path, monkeypatch):
    assert ref_problem(f"{__name__}:double") is None
    assert "AttributeError" in ref_problem(f"{__name__}:no_such")
    assert ref_problem("json:__name__") == "is not callable (str)"
    # An imported module's attributes are checked; a module not imported yet is only looked for, never run.
    assert locate_problem("kernels_core._refs:no_such") == (
        "module 'kernels_core._refs' has no attribute 'no_such'")
    assert locate_problem("json.no_such_sub:f") == "module 'json.no_such_sub' not found"
    assert locate_problem("json.decoder.deeper:f") == (
        "module 'json.decoder.deeper' not found ('json.decoder' is not a package)")
    package = tmp_path / "demo_unimported"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (package / "ops.py").write_text("raise RuntimeError('must not be imported')\n\n\ndef f():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert locate_problem("demo_unimported.ops:f") is None
    # The module's source is read for the attribute, still without running it.
    assert locate_problem("demo_unimported.ops:g") == (
        "module 'demo_unimported.ops' has no attribute 'g' (its source defines, assigns or imports none)")
    assert locate_problem("demo_unimported.nope:f") == "module 'demo_unimported.nope' not found"
    assert "demo_unimported" not in sys.modules
