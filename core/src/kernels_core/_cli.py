"""``kernels-core`` command line: what is installed and detected, which kinds and kernels exist, whether they conform.

Devices are named as a tensor on them prints its device (``cpu``, ``cuda:0``), as in kernelize reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from . import __version__
from . import list_kernels
from . import list_plugins
from ._check import DEFAULT_COMPILE_BACKEND
from ._hints import did_you_mean
from ._plugins._manager import get_plugin_manager
from ._plugins._records import KernelProblem
from ._report import format_table
from ._types import Supports
from ._types import device_name


__all__ = ["main"]


def _plugins(args: argparse.Namespace) -> int:
    plugins = list_plugins()
    conflicts = get_plugin_manager().conflicts
    if args.json:
        print(json.dumps({"plugins": [asdict(p) for p in plugins], "conflicts": conflicts}, indent=2))
        return 0
    rows = [(p.name, p.status, p.distribution or "-", p.version or "-", p.module, p.reason or "") for p in plugins]
    print(format_table(("plugin", "status", "distribution", "version", "module", "reason"), rows))
    for conflict in conflicts:
        print(f"conflict: {conflict}")
    return 0


def _devices(args: argparse.Namespace) -> int:
    pm = get_plugin_manager()
    backends = pm.backends()
    if args.json:
        payload = [{**asdict(b), "count": b.count, "plugin": p.name} for b, p in backends]
        print(json.dumps({"backends": payload}, indent=2))
        return 0
    rows = []
    for backend, plugin in backends:
        if not backend.devices:
            rows.append((backend.backend, backend.device_type, "-", f"(none: {backend.reason or 'not detected'})",
                         "-", str(backend.priority), plugin.name))
        for device in backend.devices:
            arch = device.arch or (f"sm_{device.capability[0]}{device.capability[1]}" if device.capability else "-")
            rows.append((backend.backend, device_name(backend.device_type, device.index), str(device.index),
                         device.name, arch, str(backend.priority), plugin.name))
    print(format_table(("backend", "torch device", "index", "name", "arch", "priority", "plugin"), rows))
    return 0


def _kernels(args: argparse.Namespace) -> int:
    pm = get_plugin_manager()
    kernels = list_kernels(backend=args.backend)
    # Kernels that are listed but will not run (undetectable backend, missing impl, a fallback seen in this
    # process), and kernels dropped from loaded plugins (a variant their kind lacks), with the reason.
    problems = pm.kernel_problems()
    rejected = [(spec, plugin, reason) for spec, plugin, reason in pm.rejected_kernels()
                if args.backend is None or spec.backend in (args.backend, "any")]
    if args.json:
        payload = []
        for spec, plugin in kernels:
            data = asdict(spec)
            for flags in ("supports", "native_when_compiled"):
                value = getattr(spec, flags)
                data[flags] = [f.name for f in type(value) if f in value and f.name]
            payload.append({**data, "plugin": plugin.name, "distribution": plugin.distribution,
                            "version": plugin.version,
                            "problems": [{"status": s, "detail": d} for s, d in problems.get(spec.id, [])]})
        dropped = [{"id": spec.id, "kind": spec.kind, "backend": spec.backend, "plugin": plugin.name,
                    "distribution": plugin.distribution, "reason": reason} for spec, plugin, reason in rejected]
        print(json.dumps({"kernels": payload, "rejected": dropped}, indent=2, default=str))
        return 0
    rows = []
    for spec, plugin in kernels:
        modes = ["train" if Supports.BACKWARD in spec.supports else "infer"]
        if Supports.TORCH_COMPILE in spec.supports:
            modes.append("compile only" if spec.compile_only else "compile")
        # float16 -> f16, bfloat16 -> bf16, float32 -> f32: keeps the table narrow.
        dtypes = ",".join(d.replace("float", "f") for d in spec.dtypes)
        status = ", ".join(s for s, _ in problems.get(spec.id, [])) or "ok"
        rows.append((spec.id, spec.kind, ",".join(spec.variants), spec.backend, str(spec.priority), "+".join(modes),
                     dtypes, plugin.name, status))
    for spec, plugin, _reason in rejected:
        rows.append((spec.id, spec.kind, ",".join(spec.variants), spec.backend, str(spec.priority), "-", "-",
                     plugin.name, str(KernelProblem.REJECTED)))
    print(format_table(("kernel", "kind", "variants", "backend", "priority", "modes", "dtypes", "plugin", "status"),
                       rows))
    for spec, plugin in kernels:
        for status, detail in problems.get(spec.id, []):
            print(f"{status}: {spec.id} ({plugin.name}): {detail}")
    for spec, plugin, reason in rejected:
        print(f"rejected: {spec.id} ({plugin.name}): {reason}")
    return 0


def _kinds(args: argparse.Namespace) -> int:
    kinds = sorted(get_plugin_manager().layer_kinds().values(), key=lambda provided: provided.kind.name)
    if args.json:
        payload = []
        for provided in kinds:
            kind = provided.kind
            options = None if kind.options is None else {
                name: [t.__name__ for t in (types if isinstance(types, tuple) else (types,))]
                for name, types in kind.options.items()}
            payload.append({"name": kind.name, "description": kind.description, "variants": list(kind.variants),
                            "target": kind.target, "hint_names": list(kind.hint_names), "options": options,
                            "opt_in": kind.opt_in,
                            "plugin": provided.plugin.name, "distribution": provided.plugin.distribution,
                            "version": provided.plugin.version})
        print(json.dumps({"kinds": payload}, indent=2))
        return 0
    rows = []
    for provided in kinds:
        kind = provided.kind
        options = "-" if not kind.options else ",".join(sorted(kind.options))
        rows.append((kind.name, ",".join(kind.variants), kind.target, options, provided.plugin.name,
                     kind.description))
    print(format_table(("kind", "variants", "target", "options", "plugin", "description"), rows))
    return 0


def _check(args: argparse.Namespace) -> int:
    from ._check import check
    from ._errors import CheckError

    try:
        report = check(args.plugins, kernels=args.kernel or (), compile=not args.no_compile,
                       compile_backend=args.compile_backend)
    except CheckError as exc:
        print(f"kernels-core check: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.table())
        print(report.summary())
        for result in report.results if args.traceback else ():
            if result.traceback:
                print(f"\n{result.kernel} ({result.plugin}), {result.dtype}, {result.case}:\n{result.traceback}",
                      end="")
    return 0 if report.ok else 1


def _known_backends() -> list[str]:
    """Backend names a plugin reports (with or without devices) or a kernel is declared for, and ``any``."""
    pm = get_plugin_manager()
    names = {backend.backend for backend, _ in pm.backends()} | {p.spec.backend for p in pm.kernels()}
    return sorted(names | {"any"})


def _check_backend(parser: argparse.ArgumentParser, backend: str | None) -> None:
    if backend is None:
        return
    known = _known_backends()
    if backend not in known:
        hint = did_you_mean(backend, known)
        parser.error(f"unknown backend {backend!r}{hint}; known backends: {', '.join(known)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernels-core",
        description="Inspect kernels-core plugins, detected devices, layer kinds and kernels, and check kernels "
                    "against the modules they replace. Also runs as `python -m kernels_core`.")
    parser.add_argument("--version", action="version", version=f"kernels-core {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, handler, help_text in (
        ("plugins", _plugins, "installed plugins, their distribution, version and load status"),
        ("devices", _devices, "backends and devices detected by the plugins"),
        ("kinds", _kinds, "layer kinds: variants, target, options and the plugin declaring each"),
        ("kernels", _kernels, "declared kernels (nothing is imported)"),
        ("check", _check, "run each kernel through its layer kind's conformance test against the eager module it "
                          "replaces; exit status 1 on any failure"),
    ):
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.add_argument("--json", action="store_true", help="print JSON instead of a table")
        command.set_defaults(handler=handler)
        if name == "kernels":
            command.add_argument("--backend", help="only kernels usable on this backend (portable ones included)")
        if name == "check":
            command.add_argument("plugins", nargs="*", metavar="PLUGIN",
                                 help="check only these plugins' kernels (default: every installed plugin)")
            command.add_argument("--kernel", action="append", metavar="ID",
                                 help="check only this kernel id (repeatable)")
            command.add_argument("--traceback", action="store_true",
                                 help="print the traceback of each exception raised in plugin code (--json always "
                                      "includes them)")
            command.add_argument("--no-compile", action="store_true",
                                 help="skip the torch.compile(fullgraph=True) runs of compile-safe kernels")
            command.add_argument("--compile-backend", default=DEFAULT_COMPILE_BACKEND, metavar="BACKEND",
                                 help="torch.compile backend of those runs (default: %(default)s, which traces "
                                      "forward and backward without generating code; 'inductor' also compiles)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_backend(parser, getattr(args, "backend", None))
    return int(args.handler(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
