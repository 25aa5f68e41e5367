"""The scaling driver of ``benchmarks.cuda.distributed_bench``: the same job under ``torchrun`` at several GPU
counts, one results file with every count, tokens/s per GPU, scaling efficiency against the smallest count, and a
chart.

Example:
    >>> runs = {n: {"variants": {"eager": {"tokens_per_s": tokens}}} for n, tokens in ((1, 100.0), (2, 180.0))}
    >>> scaling(runs)["eager"]["efficiency"]
    {'1': 1.0, '2': 0.9}
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
from collections.abc import Callable
from typing import Any

from benchmarks.common import child_env
from benchmarks.common import pyplot
from benchmarks.common import python_m
from benchmarks.common import write_json


__all__ = ["chart", "child_args", "combine", "scale", "scaling", "scaling_targets", "write_scaling"]


def child_args(args: argparse.Namespace, out: pathlib.Path) -> list[str]:
    """This job's options for one torchrun at one GPU count."""
    argv = ["--out", str(out), "--model", args.model, "--variants", args.variants, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--device", args.device, "--repeats", str(args.repeats),
            "--optimizer", args.optimizer, "--layers-per-unit", str(args.layers_per_unit)]
    argv += ["--layers", str(args.layers)] if args.layers else []
    argv += ["--peft", args.peft] if getattr(args, "peft", None) else []
    argv += ["--gc", args.gc] if getattr(args, "gc", "default") != "default" else []
    argv += [flag for flag, on in (("--tiny", args.tiny), ("--print-report", args.print_report),
                                   ("--no-reshard", args.no_reshard), ("--profile", args.profile),
                                   ("--host-profile", args.host_profile),
                                   ("--no-floor", getattr(args, "no_floor", False))) if on]
    argv += [item for key in ("batch", "seq") if getattr(args, key) for item in (f"--{key}", str(getattr(args, key)))]
    return argv


def scaling(runs: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: tokens/s per GPU at each count and its efficiency against the smallest count's."""
    counts = sorted(runs)
    out: dict[str, dict[str, Any]] = {}
    for name in {name for run in runs.values() for name in run.get("variants", {})}:
        per_gpu = {n: runs[n]["variants"][name]["tokens_per_s"] / n for n in counts
                   if "tokens_per_s" in runs[n].get("variants", {}).get(name, {})}
        if not per_gpu:
            continue
        first = min(per_gpu)
        out[name] = {"tokens_per_s_per_gpu": {str(n): round(v) for n, v in per_gpu.items()},
                     "efficiency": {str(n): round(v / per_gpu[first], 4) for n, v in per_gpu.items()},
                     "relative_to_gpus": first}
    return out


def scaling_targets(table: dict[str, dict[str, Any]], baseline: Callable[[str], str | None]) -> list[dict[str, Any]]:
    """Kernelized variants scale no worse than their eager baseline (1% of slack for run-to-run noise);
    ``baseline(name)`` is the variant a kernelized one is compared with, None for an eager one."""
    out = []
    for name, row in sorted(table.items()):
        if baseline(name) is None or baseline(name) not in table:
            continue
        base = table[baseline(name)]["efficiency"]
        for n, value in row["efficiency"].items():
            if n in base and int(n) != row["relative_to_gpus"]:
                out.append({"name": f"{name} scaling efficiency at {n} GPUs vs {baseline(name)}'s",
                            "value": [value, base[n]], "target": ">= baseline's - 0.01",
                            "met": value >= base[n] - 0.01})
    return out


def scale(args: argparse.Namespace, counts: list[int], *, module: str, baseline: Callable[[str], str | None]) -> int:
    """Run ``module`` under torchrun at each GPU count; one file with every count, scaling and a chart."""
    runs: dict[int, dict[str, Any]] = {}
    failed = False
    for n in counts:
        part = args.out.with_name(f".{args.out.stem}-{n}.json")
        cmd = python_m(module, *child_args(args, part), torchrun=["--standalone", "--nproc_per_node", str(n)])
        print(f"== {n} processes: {' '.join(cmd)}", flush=True)
        failed |= subprocess.run(cmd, check=False, env=child_env()).returncode != 0
        try:
            runs[n] = json.loads(part.read_text())
        except (OSError, ValueError) as exc:
            runs[n] = {"error": f"no result from the {n}-process job: {exc}"}
            failed = True
    write_scaling(runs, args.out, model=args.model, baseline=baseline)
    return 1 if failed else 0


def combine(parts: dict[int, pathlib.Path], out: pathlib.Path, *, baseline: Callable[[str], str | None]) -> None:
    """One scaling file from result files written at each GPU count by separate torchrun jobs (for example jobs
    run side by side on disjoint GPUs of one host)."""
    runs = {n: json.loads(path.read_text()) for n, path in sorted(parts.items())}
    write_scaling(runs, out, model=runs[max(runs)].get("model", "?"), baseline=baseline)


def write_scaling(runs: dict[int, dict[str, Any]], out: pathlib.Path, *, model: str,
                  baseline: Callable[[str], str | None]) -> None:
    table = scaling(runs)
    checks = [{**c, "name": f"{n} GPUs: {c['name']}"} for n, run in runs.items() for c in run.get("targets", [])]
    checks += scaling_targets(table, baseline)
    largest = runs[max(runs)]
    write_json(out, {"environment": largest.get("environment"), "model": model, "config": largest.get("config"),
                     "steps_timed": largest.get("steps_timed"), "steps_warmup": largest.get("steps_warmup"),
                     "runs": {str(n): run for n, run in runs.items()}, "scaling": table, "targets": checks,
                     "all_targets_met": all(c["met"] for c in checks)})
    for name, row in sorted(table.items()):
        print(f"{name:20} tokens/s per GPU {row['tokens_per_s_per_gpu']}  efficiency {row['efficiency']}")
    for check in checks:
        print(f"[{'ok' if check['met'] else 'MISSED'}] {check['name']}: {check['value']} (target {check['target']})")
    chart(runs, table, out.with_suffix(".png"), model)
    print(f"wrote {out}", flush=True)


def chart(runs: dict[int, dict[str, Any]], table: dict[str, dict[str, Any]], path: pathlib.Path,
           model: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, row in sorted(table.items()):
        counts = [int(n) for n in row["tokens_per_s_per_gpu"]]
        left.plot(counts, list(row["tokens_per_s_per_gpu"].values()), marker="o", label=name)
        peaks = [runs[n]["variants"][name].get("peak_GiB") for n in counts]
        right.plot(counts, [p or 0 for p in peaks], marker="o", label=name)
    for axis, label in ((left, "tokens/s per GPU"), (right, "peak GiB per rank")):
        axis.set_xlabel("GPUs")
        axis.set_ylabel(label)
        axis.set_xticks(sorted(runs))
        axis.legend(fontsize=8)
    fig.suptitle(f"FSDP2 training, {model} shape")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
