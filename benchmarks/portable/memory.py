"""Training-step peak memory and time, eager against kernelized with the core's portable kernels (not a test).

    python -m benchmarks.portable.memory                                   # demo model on CPU
    python -m benchmarks.portable.memory --device cuda --shape qwen3-0.6b  # Qwen3-0.6B shape, bf16, 4 x 2048

Every variant trains the same seeded model on the same batches in a process of its own, so peaks do not mix:
on CPU the resident-set high-water mark reset before the first step (Linux ``VmHWM``), on CUDA
``torch.cuda.max_memory_allocated``. Besides ``eager`` and ``kernelized`` (every portable kernel), two
ablations show where the savings come from: ``loss-only`` and ``no-loss`` (norm and MLP kernels only).
Only the core's own plugins load by default (``--plugins core``), so a machine with a vendor package installed still
measures the portable kernels; ``--plugins installed`` measures whatever kernelize picks there instead.
Needs only torch, transformers and the repository's ``core/src`` (installed, or on ``PYTHONPATH``).
Results go to ``benchmarks/results/portable-<device>[-<shape>].json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.common import child_env
from benchmarks.common import python_m
from benchmarks.common import write_json
from benchmarks.portable import workload


VARIANTS = ("eager", "kernelized", "loss-only", "no-loss")
# kernelize configurations per variant; None means eager (kernelize is never called).
CONFIGS: dict[str, dict | None] = {
    "eager": None,
    "kernelized": {},
    "loss-only": {"kinds": {k: {"enabled": False} for k in ("rms_norm", "silu_gated_mlp", "rotary_embedding")}},
    "no-loss": {"kinds": {"causal_lm_loss": {"enabled": False}}},
}


def _ensure_builtin_plugins() -> str:
    """The core's own plugins come from its entry points: without an installed kernels-core (``core/src`` only on
    PYTHONPATH) there are none, and the run would measure nothing."""
    import kernels_core

    loaded = {p.name for p in kernels_core.list_plugins() if p.status == "loaded"}
    missing = [name for name in ("builtin", "portable") if name not in loaded]
    if missing:
        raise SystemExit(f"kernels-core's plugins {missing} are not installed: pip install -e core (or ./core) so "
                         "that its entry points exist")
    return "entry points"


def worker(variant: str, shape_name: str, device_name: str, steps: int, plugins: str) -> dict:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if plugins == "core":
        # The allow list always keeps ``builtin``; naming ``portable`` keeps vendor plugins out.
        os.environ["KERNELS_CORE_PLUGINS"] = "portable"
    import torch

    shape = workload.SHAPES[shape_name]
    device = torch.device(device_name)
    model = workload.build_model(shape, device=device)
    summary = {}
    config = CONFIGS[variant]
    if config is not None:
        import kernels_core

        summary["core_plugins"] = _ensure_builtin_plugins()
        kernels_core.kernelize(model, config=config)
        report = kernels_core.get_report(model)
        applied: dict[str, int] = {}
        for entry in report.entries:
            if entry.applied:
                applied[entry.kernel] = applied.get(entry.kernel, 0) + 1
        summary["kernels"] = applied
        # The core's own kernels: portable ("any.") and the CPU-only ones its portable plugin declares.
        core_kernels = {spec.id for spec, plugin in kernels_core.list_kernels()
                        if plugin.name in ("builtin", "portable")}
        foreign = sorted(k for k in applied if k not in core_kernels)
        if plugins == "core" and foreign:
            raise SystemExit(f"--plugins core, yet kernelize applied non-portable kernels {foreign}")
    result = workload.train(model, shape, device=device, steps=steps)
    return {**result, **summary}


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    command = python_m("benchmarks.portable.memory", "--worker", variant, "--shape", args.shape, "--device",
                       args.device, "--steps", str(args.steps), "--plugins", args.plugins)
    done = subprocess.run(command, capture_output=True, text=True, env=child_env())
    if done.returncode != 0:
        sys.exit(f"variant {variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def steady_seconds(times: list[float]) -> float:
    """Median step time after the first step (which pays one-off allocations, lazy imports, autotuning)."""
    rest = sorted(times[1:] or times)
    return rest[len(rest) // 2]


def best_seconds(times: list[float]) -> float:
    """Fastest step after the first: on a shared machine the least disturbed by other processes."""
    return min(times[1:] or times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="demo", choices=("demo", "qwen3-0.6b"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/portable-...json)")
    parser.add_argument("--plugins", default="core", choices=("core", "installed"),
                        help="core: only the core's portable kernels (default); installed: every installed plugin")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.shape, args.device, args.steps, args.plugins)))
        return 0

    import torch
    import transformers

    variants = [v for v in args.variants.split(",") if v]
    if "eager" not in variants:
        variants.insert(0, "eager")
    results = {}
    for variant in variants:
        print(f"running {variant} ...", file=sys.stderr, flush=True)
        results[variant] = run_variant(variant, args)

    eager = results["eager"]
    eager_peak, eager_time = eager["peak_bytes"], steady_seconds(eager["step_seconds"])
    rows = []
    for variant, r in results.items():
        loss_error = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], eager["losses"], strict=True))
        r["summary"] = {
            "peak_mib": r["peak_bytes"] / 2**20,
            "peak_above_baseline_mib": (r["peak_bytes"] - r["baseline_bytes"]) / 2**20,
            "steady_step_seconds": steady_seconds(r["step_seconds"]),
            "peak_ratio_vs_eager": r["peak_bytes"] / eager_peak,
            "above_baseline_ratio_vs_eager": (r["peak_bytes"] - r["baseline_bytes"])
            / max(eager_peak - eager["baseline_bytes"], 1),
            "time_ratio_vs_eager": steady_seconds(r["step_seconds"]) / eager_time,
            "best_step_seconds": best_seconds(r["step_seconds"]),
            "best_time_ratio_vs_eager": best_seconds(r["step_seconds"]) / best_seconds(eager["step_seconds"]),
            "max_loss_rel_diff_vs_eager": loss_error,
        }
        s = r["summary"]
        rows.append(
            (
                variant,
                f"{s['peak_mib']:,.0f}",
                f"{s['peak_above_baseline_mib']:,.0f}",
                f"{s['peak_ratio_vs_eager']:.2f}",
                f"{s['steady_step_seconds'] * 1000:,.0f}",
                f"{s['time_ratio_vs_eager']:.2f}",
                f"{s['best_step_seconds'] * 1000:,.0f}",
                f"{s['best_time_ratio_vs_eager']:.2f}",
                f"{loss_error:.1e}",
            )
        )

    shape = workload.SHAPES[args.shape]
    header = (
        "variant",
        "peak MiB",
        "above baseline MiB",
        "peak x eager",
        "median step ms",
        "x eager",
        "best step ms",
        "x eager",
        "max loss rel diff",
    )
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    print(
        f"{args.shape} on {args.device}: batch {shape.batch} x {shape.seq_len}, {shape.dtype}, "
        f"{args.steps} AdamW steps; peak = {eager['peak_method']}"
    )
    for row in (header, *rows):
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))

    kernelized = results.get("kernelized", {}).get("summary")
    target = None
    if kernelized is not None and args.device == "cpu":
        target = {
            "peak_ratio_max": 0.6,
            "loss_rel_diff_max": 1e-5,
            "met": kernelized["peak_ratio_vs_eager"] <= 0.6 and kernelized["max_loss_rel_diff_vs_eager"] <= 1e-5,
        }
        print(
            f"target (CPU): kernelized peak <= 0.6x eager and losses within 1e-5: "
            f"{'met' if target['met'] else 'NOT met'}"
        )
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    record = {
        "benchmark": "portable_memory",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "device_name": device_name or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shape": {"name": args.shape, **shape.__dict__},
        "steps": args.steps,
        "plugins": args.plugins,
        "peak_method": eager["peak_method"],
        "target": target,
        "variants": results,
    }
    suffix = args.device.split(":")[0] + ("" if args.shape == "demo" else f"-{args.shape}")
    suffix += "" if args.plugins == "core" else "-installed-plugins"
    out = Path(args.out) if args.out else RESULTS / f"portable-{suffix}.json"
    write_json(out, record)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
