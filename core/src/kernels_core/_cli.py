"""``kernels-core`` command line: what is installed, what was detected, which kernels exist."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from . import list_kernels
from . import list_plugins
from ._manager import get_plugin_manager
from ._report import format_table
from ._types import Supports


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
            rows.append((backend.backend, f"{backend.device_type}:{device.index}", str(device.index), device.name,
                         arch, str(backend.priority), plugin.name))
    print(format_table(("backend", "torch device", "index", "name", "arch", "priority", "plugin"), rows))
    return 0


def _kernels(args: argparse.Namespace) -> int:
    kernels = list_kernels(backend=args.backend)
    if args.json:
        payload = []
        for spec, plugin in kernels:
            data = asdict(spec)
            data["supports"] = [f.name for f in type(spec.supports) if f in spec.supports and f.name]
            payload.append({**data, "plugin": plugin.name, "distribution": plugin.distribution,
                            "version": plugin.version})
        print(json.dumps({"kernels": payload}, indent=2, default=str))
        return 0
    rows = []
    for spec, plugin in kernels:
        modes = ["train" if Supports.BACKWARD in spec.supports else "infer"]
        if Supports.TORCH_COMPILE in spec.supports:
            modes.append("compile")
        # float16 -> f16, bfloat16 -> bf16, float32 -> f32: keeps the table narrow.
        dtypes = ",".join(d.replace("float", "f") for d in spec.dtypes)
        rows.append((spec.id, spec.kind, ",".join(spec.variants), spec.backend, str(spec.priority), "+".join(modes),
                     dtypes, plugin.name))
    print(format_table(("kernel", "kind", "variants", "backend", "priority", "modes", "dtypes", "plugin"), rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernels-core",
                                     description="Inspect kernels-core plugins, detected devices and kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, handler, help_text in (
        ("plugins", _plugins, "installed plugins, their distribution, version and load status"),
        ("devices", _devices, "backends and devices detected by the plugins"),
        ("kernels", _kernels, "declared kernels (nothing is imported)"),
    ):
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.add_argument("--json", action="store_true", help="print JSON instead of a table")
        command.set_defaults(handler=handler)
        if name == "kernels":
            command.add_argument("--backend", help="only kernels usable on this backend (portable ones included)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
