"""Read torch_npu's operator schemas out of release wheels, and check calls and emulated signatures against them.

A torch_npu wheel carries the schema of every operator it registers in ``torch_npu/csrc/aten/*.yaml`` (``func:``
entries in the syntax of PyTorch's ``native_functions.yaml``; kernels-npu's operators are all in
``npu_native_functions_by_codegen.yaml``), and its ``torch.npu`` device module as Python source under
``torch_npu/npu/``. Both are read straight from the zip: importing torch_npu needs CANN, so the wheels are
downloaded with ``pip download`` and never installed. Those files are the same in every wheel of one release
(x86_64 and aarch64, every CPython tag), so one x86_64 CPython 3.11 wheel per release stands for all of them.

What is checked (``tests/test_vendor_schemas.py`` runs it):

- each ``torch_npu.npu_*`` call in kernels-npu's source, found by walking its syntax tree: positional count, keyword
  names, required arguments, keyword-only markers, literal argument types, and how the result is consumed (an
  index or a tuple unpacking must fit the operator's return arity), against the operator's unnamed overload
  (``npu_grouped_matmul.List``, group_list as ``int[]``, is another, which kernels-npu does not use);
- each operator the test emulation defines: its Python signature must be exactly the part of the schema that the
  oldest and the newest supported release share (names, order, defaults, keyword-only markers, types, returns).

Example:
    >>> sig = parse_schema("npu_swiglu(Tensor self, int dim=-1) -> Tensor", source="example")
    >>> [(p.name, p.default) for p in sig.params]
    [('self', <required>), ('dim', -1)]
"""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import typing
import zipfile
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from pathlib import Path

import torch


__all__ = [
    "DEVICE_FUNCTIONS",
    "NEWEST",
    "OLDEST",
    "REQUIRED",
    "CallSite",
    "Param",
    "Release",
    "Signature",
    "WheelUnavailable",
    "cache_dir",
    "check_call",
    "check_emulated",
    "collect_call_sites",
    "common_signature",
    "download_wheel",
    "parse_schema",
    "read_release",
    "signature_of",
]

# The supported range is `torch-npu>=OLDEST` (plugins-npu/pyproject.toml, extra `ascend`). OLDEST is the first
# release whose eager npu_grouped_matmul has the k-axis grouping (group_type=2) the experts' weight gradient uses:
# the library of 2.5.1.post1 and 2.6.0 carries "group_type currently only support -1 and 0", and 2.5.1 and older
# releases for torch >= 2.4 lack npu_moe_token_permute. NEWEST is the newest release on PyPI when this was last
# checked; raise it, and re-run the tests, when torch_npu publishes a newer one.
OLDEST = "2.6.0.post3"
NEWEST = "2.14.0"
# One wheel per release: its schemas and Python sources are the same for every platform and CPython tag, and
# both releases publish a CPython 3.11 x86_64 wheel.
_WHEEL_TAGS = ("--implementation", "cp", "--python-version", "3.11", "--abi", "cp311",
               "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
               "--platform", "manylinux2014_x86_64")
# The torch.npu functions kernels-npu's detection calls (and the emulation's `npu` module defines).
DEVICE_FUNCTIONS = ("current_device", "device_count", "get_device_name", "is_available")
_DEVICE_SOURCES = ("torch_npu/npu/__init__.py", "torch_npu/npu/utils.py")


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED: object = _Required()


class WheelUnavailable(RuntimeError):
    """The wheel could not be downloaded (no package index, no such release); the message says why."""


# ---------------------------------------------------------------------------------------------------------------
# Signatures


@dataclass(frozen=True)
class Param:
    """One parameter. ``types`` holds schema type texts (``"Tensor?"``); several where releases differ, none for a
    Python-defined function. ``default`` is :data:`REQUIRED` when there is none."""

    name: str
    types: frozenset[str]
    default: object
    keyword_only: bool


@dataclass(frozen=True)
class Signature:
    """An operator schema or a Python function's signature; ``returns`` is ``None`` when unknown (Python)."""

    name: str
    params: tuple[Param, ...]
    returns: tuple[str, ...] | None
    source: str

    @property
    def positional(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if not p.keyword_only)

    def __str__(self) -> str:
        def one(p: Param) -> str:
            text = f"{'|'.join(sorted(p.types))} {p.name}".strip()
            return text if p.default is REQUIRED else f"{text}={p.default!r}"

        parts = [one(p) for p in self.positional]
        keyword_only = [one(p) for p in self.params if p.keyword_only]
        if keyword_only:
            parts += ["*", *keyword_only]
        if self.returns is None:
            return f"{self.name}({', '.join(parts)})"
        returns = self.returns[0] if len(self.returns) == 1 else f"({', '.join(self.returns)})"
        return f"{self.name}({', '.join(parts)}) -> {returns}"


def _schema_default(text: str | None) -> object:
    if text is None:
        return REQUIRED
    if text in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[text]
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    value = ast.literal_eval(text)  # quoted strings, lists
    return tuple(value) if isinstance(value, list) else value


def parse_schema(func: str, *, source: str) -> Signature:
    """Parse one ``func:`` schema with torchgen (shipped inside torch), the parser torch_npu's own codegen uses.

    The name keeps its overload (``npu_grouped_matmul.List``); the unnamed overload is just the operator's name.
    """
    from torchgen.model import FunctionSchema

    schema = FunctionSchema.parse(func)
    arguments = schema.arguments
    params = [Param(a.name, frozenset({str(a.type)}), _schema_default(a.default), False)
              for a in arguments.flat_positional]
    params += [Param(a.name, frozenset({str(a.type)}), _schema_default(a.default), True)
               for a in arguments.flat_kwarg_only]
    params += [Param(a.name, frozenset({str(a.type)}), REQUIRED, True) for a in arguments.out]
    name = str(schema.name)
    return Signature(name, tuple(params), tuple(str(r.type) for r in schema.returns), source)


def _python_default(node: ast.expr | None) -> object:
    if node is None:
        return REQUIRED
    try:
        return ast.literal_eval(node)
    except ValueError:
        return f"<expression {ast.unparse(node)}>"


def _python_signature(function: ast.FunctionDef, *, source: str) -> Signature:
    args = function.args
    if args.posonlyargs or args.vararg or args.kwarg:
        raise ValueError(f"{source}: {function.name} takes positional-only, *args or **kwargs parameters")
    defaults: list[ast.expr | None] = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    params = [Param(a.arg, frozenset(), _python_default(d), False) for a, d in zip(args.args, defaults, strict=True)]
    params += [Param(a.arg, frozenset(), _python_default(d), True)
               for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    return Signature(function.name, tuple(params), None, source)


def signature_of(function: Callable[..., object], *, typed: bool = True) -> tuple[Signature, dict[str, object]]:
    """A Python function's signature (types left empty) and, when ``typed``, its evaluated annotations."""
    params = []
    for p in inspect.signature(function).parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise ValueError(f"{function.__qualname__}: parameter {p.name} is {p.kind.description}, which no "
                             "operator schema has")
        default = REQUIRED if p.default is p.empty else p.default
        params.append(Param(p.name, frozenset(), default, p.kind == p.KEYWORD_ONLY))
    hints = typing.get_type_hints(function) if typed else {}
    return Signature(function.__name__, tuple(params), None, inspect.getsourcefile(function) or "?"), hints


# ---------------------------------------------------------------------------------------------------------------
# Releases


@dataclass
class Release:
    """What one torch_npu wheel declares: operator schemas and the device functions' signatures."""

    version: str
    wheel: Path
    # `name` or `name.overload` -> (schema text, file); parsed on demand by operator().
    schemas: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    device_functions: dict[str, Signature] = field(default_factory=dict)
    schema_files: tuple[str, ...] = ()

    def operator(self, name: str) -> Signature:
        """The schema of ``name`` (``npu_grouped_matmul`` is the unnamed overload, ``npu_grouped_matmul.List``
        another).

        Raises:
            KeyError: no file of the wheel declares it.
            ValueError: it is declared twice with two different schemas (which one torch_npu registers is unknown).
        """
        if name not in self.schemas:
            raise KeyError(f"torch_npu {self.version} declares no operator {name!r} (read {list(self.schema_files)})")
        parsed = [parse_schema(func, source=f"torch_npu {self.version}: {member}")
                  for func, member in self.schemas[name]]
        for other in parsed[1:]:
            if (other.params, other.returns) != (parsed[0].params, parsed[0].returns):
                raise ValueError(f"torch_npu {self.version}: {name} has two schemas:\n  {parsed[0]} "
                                 f"({parsed[0].source})\n  {other} ({other.source})")
        return parsed[0]


def _func_entries(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        func = node.get("func")
        if isinstance(func, str):
            yield func
        for value in node.values():
            yield from _func_entries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _func_entries(item)


def read_release(wheel: Path, version: str) -> Release:
    """Collect every operator schema (``func:`` entries of any ``torch_npu/**.yaml``) and the device functions.

    Entries without an argument list (``func: clone`` in the list of supported ATen operators) name operators
    declared elsewhere and are skipped.
    """
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    release = Release(version, wheel)
    files = []
    with zipfile.ZipFile(wheel) as archive:
        for member in sorted(archive.namelist()):
            if not (member.startswith("torch_npu/") and member.endswith(".yaml")):
                continue
            entries = [func for func in _func_entries(yaml.load(archive.read(member), Loader=loader)) if "(" in func]
            if entries:
                files.append(member)
            for func in entries:
                release.schemas.setdefault(func.split("(", 1)[0].strip(), []).append((func, member))
        for member in _DEVICE_SOURCES:
            tree = ast.parse(archive.read(member))
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name in DEVICE_FUNCTIONS:
                    release.device_functions.setdefault(
                        node.name, _python_signature(node, source=f"torch_npu {version}: {member}"))
    release.schema_files = tuple(files)
    return release


def cache_dir() -> Path:
    """Where downloaded wheels are kept: ``$KERNELS_NPU_WHEEL_CACHE``, else ``~/.cache/kernels-npu-tests``."""
    configured = os.environ.get("KERNELS_NPU_WHEEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kernels-npu-tests"


def _cached(directory: Path, version: str) -> Path | None:
    for wheel in sorted(directory.glob(f"torch_npu-{version}-cp311-cp311-*x86_64*.whl")):
        try:
            with zipfile.ZipFile(wheel):  # wheels enter the cache only once pip has checked them; this is a guard
                return wheel
        except (OSError, zipfile.BadZipFile):
            wheel.unlink(missing_ok=True)  # damaged since: fetch it again
    return None


def download_wheel(version: str, *, cache: Path | None = None, timeout: float = 900.0) -> Path:
    """The torch_npu ``version`` wheel (CPython 3.11, x86_64), from the cache or else from the package index.

    ``pip download`` honours pip's own configuration (index URL, proxy, certificates). A partial download never
    lands in the cache: pip writes into a temporary folder, and the wheel is moved in once complete.

    Raises:
        WheelUnavailable: pip could not fetch it; the message carries pip's last lines.
    """
    directory = cache or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = _cached(directory, version)
    if wheel is not None:
        return wheel
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar",
                   "off", "--disable-pip-version-check", *_WHEEL_TAGS, "--dest", tmp, f"torch-npu=={version}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise WheelUnavailable(f"pip download torch-npu=={version}: {exc}") from exc
        fetched = sorted(Path(tmp).glob(f"torch_npu-{version}-*.whl"))
        if done.returncode != 0 or not fetched:
            # pip's warnings say why (no connection, proxy, certificate); its last error only that nothing matched.
            said = [line for line in (done.stderr + done.stdout).splitlines() if line.startswith(("WARNING", "ERROR"))]
            raise WheelUnavailable(f"pip download torch-npu=={version} failed (exit {done.returncode}): "
                                   + " | ".join(said[-3:] or ["no output"]))
        target = directory / fetched[0].name
        shutil.move(str(fetched[0]), target)
    return target


# ---------------------------------------------------------------------------------------------------------------
# Comparing signatures


def _same_default(a: object, b: object) -> bool:
    if a is REQUIRED or b is REQUIRED:
        return a is b
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return type(a) is type(b) and a == b


def common_signature(a: Signature, b: Signature) -> Signature:
    """The part of two releases' schemas a caller may rely on with either: the shared leading positional parameters
    and the shared keyword-only ones, each with one name and default (types may differ: both are kept).

    Raises:
        ValueError: when the two disagree on the return types, or one requires a parameter the other lacks (then
            no call suits both, and the plugin must branch on the version).
    """
    params: list[Param] = []
    for pa, pb in zip(a.positional, b.positional, strict=False):
        if pa.name != pb.name or not _same_default(pa.default, pb.default):
            break
        params.append(replace(pa, types=pa.types | pb.types))
    keyword_b = {p.name: p for p in b.params if p.keyword_only}
    for pa in (p for p in a.params if p.keyword_only):
        pb = keyword_b.get(pa.name)
        if pb is not None and _same_default(pa.default, pb.default):
            params.append(replace(pa, types=pa.types | pb.types))
    kept = {p.name for p in params}
    required_elsewhere = [f"{p.name} ({sig.source})" for sig in (a, b) for p in sig.params
                          if p.default is REQUIRED and p.name not in kept]
    if required_elsewhere:
        raise ValueError(f"{a.name}: no common signature, required only in one release: {required_elsewhere}\n"
                         f"  {a}\n  {b}")
    if a.returns != b.returns:
        raise ValueError(f"{a.name}: return types differ between releases:\n  {a} ({a.source})\n  {b} ({b.source})")
    return Signature(a.name, tuple(params), a.returns, f"common to {a.source} and {b.source}")


_PYTHON_TYPES: dict[str, object] = {
    "Tensor": torch.Tensor, "int": int, "SymInt": int, "float": float, "bool": bool, "str": str,
    "ScalarType": torch.dtype,
}


def _annotation(schema_type: str) -> object:
    """The Python annotation of a schema type: ``Tensor?`` -> ``torch.Tensor | None``, ``int[]`` -> ``list[int]``."""
    optional = schema_type.endswith("?")
    base = schema_type[:-1] if optional else schema_type
    if base.endswith("]"):
        annotation: object = list[_annotation(base[: base.index("[")])]  # type: ignore[misc]
    else:
        annotation = _PYTHON_TYPES[base]
    return annotation | None if optional else annotation  # type: ignore[operator]


def _returns_annotation(returns: tuple[str, ...]) -> object:
    if len(returns) == 1:
        return _annotation(returns[0])
    return tuple[tuple(_annotation(r) for r in returns)]  # type: ignore[misc]


def check_emulated(function: Callable[..., object], expected: Signature) -> list[str]:
    """Differences between an emulated function and the signature it must have; empty when they agree.

    Names and order, keyword-only markers and defaults always; annotations and the return annotation when
    ``expected`` has types (operator schemas), against the Python form of any of the releases' types.
    """
    typed = expected.returns is not None
    actual, hints = signature_of(function, typed=typed)
    where = f"emulated {function.__module__}.{function.__name__}"
    errors = []
    names, wanted = [p.name for p in actual.params], [p.name for p in expected.params]
    if names != wanted:
        errors.append(f"{where}: parameters {names}, expected {wanted}")
    by_name = {p.name: p for p in actual.params}
    for want in expected.params:
        have = by_name.get(want.name)
        if have is None:
            continue
        if have.keyword_only != want.keyword_only:
            errors.append(f"{where}: {want.name} is {'keyword-only' if have.keyword_only else 'positional'}, "
                          f"expected {'keyword-only' if want.keyword_only else 'positional'}")
        if not _same_default(have.default, want.default):
            errors.append(f"{where}: {want.name} defaults to {have.default!r}, expected {want.default!r}")
        if typed and want.types:
            allowed = [_annotation(t) for t in sorted(want.types)]
            if hints.get(want.name) not in allowed:
                errors.append(f"{where}: {want.name} is annotated {hints.get(want.name)!r}, expected one of "
                              f"{allowed} (schema {'|'.join(sorted(want.types))})")
    if typed and expected.returns is not None:
        returns = _returns_annotation(expected.returns)
        if hints.get("return") != returns:
            errors.append(f"{where}: returns {hints.get('return')!r}, expected {returns!r} "
                          f"(schema -> ({', '.join(expected.returns)}))")
    if errors:
        errors.append(f"  expected: {expected}\n            ({expected.source})")
    return errors


# ---------------------------------------------------------------------------------------------------------------
# Call sites


@dataclass(frozen=True)
class CallSite:
    """One call found in the source. Argument kinds are ``"none"``, ``"bool"``, ``"int"``, ``"float"``, ``"str"``,
    ``"list"`` for literals (and names bound once at module level to one), ``None`` when not known statically.
    ``result`` is ``("index", i)`` (``i`` -1 when not a literal), ``("unpack", n)``, or ``None`` (used whole)."""

    function: str
    where: str
    positional: tuple[str | None, ...]
    keywords: tuple[tuple[str, str | None], ...]
    unpacked: bool
    result: tuple[str, int] | None


def _kind(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _module_constants(tree: ast.Module) -> dict[str, str]:
    counts: dict[str, int] = {}
    kinds: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            counts[node.id] = counts.get(node.id, 0) + 1
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                kinds[node.targets[0].id] = _kind(ast.literal_eval(node.value))
            except ValueError:
                pass
    return {name: kind for name, kind in kinds.items() if counts.get(name) == 1}


def _arg_kind(node: ast.expr, constants: dict[str, str]) -> str | None:
    if isinstance(node, (ast.List, ast.Tuple)):
        return "list"
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    try:
        return _kind(ast.literal_eval(node))
    except ValueError:
        return None


def _result_use(call: ast.Call, parent: ast.AST | None) -> tuple[str, int] | None:
    if isinstance(parent, ast.Subscript) and parent.value is call:
        index = parent.slice
        return ("index", index.value if isinstance(index, ast.Constant) and isinstance(index.value, int) else -1)
    if (isinstance(parent, ast.Assign) and parent.value is call and len(parent.targets) == 1
            and isinstance(parent.targets[0], (ast.Tuple, ast.List))
            and not any(isinstance(e, ast.Starred) for e in parent.targets[0].elts)):
        return ("unpack", len(parent.targets[0].elts))
    return None


def _is_device_module(node: ast.expr) -> bool:
    # Detection calls the device module through a name `npu` (torch.npu or torch_npu.npu), or spells it out.
    if isinstance(node, ast.Name):
        return node.id == "npu"
    return isinstance(node, ast.Attribute) and node.attr == "npu"


def collect_call_sites(files: Iterable[Path], *, root: Path) -> tuple[list[CallSite], list[CallSite], list[str]]:
    """Walk the source files for ``<x>.npu_*(...)`` operator calls and ``npu.<device function>(...)`` calls.

    Returns ``(operator calls, device calls, problems)``. A problem is a use the walk cannot check: an ``npu_*``
    attribute read without being called (an alias), ``getattr(x, "npu_...")``, or ``from torch_npu import ...``;
    every operator call must be spelled as a direct call so that this check sees it.
    """
    operators: list[CallSite] = []
    devices: list[CallSite] = []
    problems: list[str] = []
    for path in sorted(files):
        tree = ast.parse(path.read_text(), filename=str(path))
        constants = _module_constants(tree)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        name = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch_npu":
                problems.append(f"{where}: `from {node.module} import ...`: call operators as torch_npu.<name>(...)")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                  and str(node.args[1].value).startswith("npu_")):
                problems.append(f"{where}: getattr(..., {node.args[1].value!r}): call the operator directly")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("npu_"):
                call = parents.get(node)
                if not (isinstance(call, ast.Call) and call.func is node):
                    problems.append(f"{where}: {ast.unparse(node)} used without being called")
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr = node.func.attr
            is_operator = attr.startswith("npu_")
            if not is_operator and not (attr in DEVICE_FUNCTIONS and _is_device_module(node.func.value)):
                continue
            site = CallSite(
                function=attr,
                where=where,
                positional=tuple(None if isinstance(a, ast.Starred) else _arg_kind(a, constants) for a in node.args),
                keywords=tuple((k.arg, _arg_kind(k.value, constants)) for k in node.keywords if k.arg is not None),
                unpacked=any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None
                                                                                   for k in node.keywords),
                result=_result_use(node, parents.get(node)),
            )
            (operators if is_operator else devices).append(site)
    return operators, devices, problems


# Literal kinds each schema base type accepts; a type not listed accepts any (it is not checked).
_ACCEPTS: dict[str, frozenset[str]] = {
    "Tensor": frozenset(), "ScalarType": frozenset(), "int": frozenset({"int"}), "SymInt": frozenset({"int"}),
    "float": frozenset({"int", "float"}), "bool": frozenset({"bool"}), "str": frozenset({"str"}),
}


def _fits(kind: str | None, types: frozenset[str]) -> bool:
    if kind is None or not types:
        return True
    for schema_type in types:
        optional = schema_type.endswith("?")
        base = schema_type[:-1] if optional else schema_type
        if kind == "none":
            if optional:
                return True
        elif base.endswith("]"):
            if kind == "list":
                return True
        elif kind in _ACCEPTS.get(base, frozenset({kind})):
            return True
    return False


def check_call(site: CallSite, sig: Signature) -> list[str]:
    """Whether a call binds to ``sig`` as Python would pass it to the operator; the problems, or empty."""
    where = f"{site.where}: {site.function}"
    if site.unpacked:
        return [f"{where}: passes *args or **kwargs, which cannot be checked against {sig}"]
    errors = []
    positional = sig.positional
    if len(site.positional) > len(positional):
        errors.append(f"{where}: {len(site.positional)} positional arguments, but only "
                      f"{[p.name for p in positional]} can be passed positionally")
    bound = {p.name: (p, kind) for p, kind in zip(positional, site.positional, strict=False)}
    by_name = {p.name: p for p in sig.params}
    for name, kind in site.keywords:
        if name not in by_name:
            errors.append(f"{where}: no parameter named {name!r}")
        elif name in bound:
            errors.append(f"{where}: {name!r} given positionally and by keyword")
        else:
            bound[name] = (by_name[name], kind)
    missing = [p.name for p in sig.params if p.default is REQUIRED and p.name not in bound]
    if missing:
        errors.append(f"{where}: required arguments not passed: {missing}")
    for name, (param, kind) in bound.items():
        if not _fits(kind, param.types):
            errors.append(f"{where}: {name} gets a {kind} literal, the schema wants {'|'.join(sorted(param.types))}")
    if sig.returns is not None:
        arity = len(sig.returns)
        is_list = arity == 1 and sig.returns[0].rstrip("?").endswith("[]")
        if site.result is None and arity > 1:
            errors.append(f"{where}: the {arity}-tuple result is kept whole; index or unpack it at the call so its "
                          "arity is checked")
        elif site.result is not None:
            use, n = site.result
            if use == "index" and not is_list and (arity == 1 or n >= arity):
                errors.append(f"{where}: result indexed [{n}], but the operator returns ({', '.join(sig.returns)})")
            if use == "unpack" and not is_list and n != arity:
                errors.append(f"{where}: result unpacked into {n}, but the operator returns "
                              f"({', '.join(sig.returns)})")
    if errors:
        errors.append(f"  schema: {sig}\n          ({sig.source})")
    return errors
