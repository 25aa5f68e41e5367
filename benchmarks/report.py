"""Tables and charts from ``benchmarks/results/*.json``: the one source of the published benchmark numbers.

The README's results table and chart, and the documentation site's benchmarks page, all come from here, so a
number changes in one place: the results file.

    python benchmarks/report.py --write           # README table (between its markers), docs/benchmarks.md, charts
    python benchmarks/report.py --check           # exit 1 if any of those is out of date (the docs build runs it)
    python benchmarks/report.py --table           # the README's table on stdout
    python benchmarks/report.py                   # the whole benchmarks page (Markdown) on stdout
    python benchmarks/report.py --out page.md --charts charts/   # page to a file, its SVG charts beside it

Each results file is named ``<benchmark>-<device>.json`` and states the commit that recorded it (``commit``, or
``environment.commit``). A file holding several runs keeps them under ``runs``, each with its own environment: a
list of named runs, or ``distributed_bench.py``'s runs by GPU count (``"1"``, ``"2"``) beside their ``scaling``.
Files this script has no table for are still listed in the inventory with their device, date and commit.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path


__all__ = ["charts", "generated", "headline_chart", "headline_rows", "headline_table", "load_results", "page",
           "summary_table", "update_readme"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
ASSETS = ROOT / "docs" / "assets"
CHART = ASSETS / "results.svg"
PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def load_results(folder: Path = RESULTS) -> dict[str, dict]:
    """Every ``*.json`` under ``folder``, by file stem (``qwen3-h200``)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def _env(data: dict) -> dict:
    return data.get("environment") or {}


def _device(data: dict) -> str:
    env = _env(data)
    return str(env.get("device") or data.get("device_name") or data.get("machine") or data.get("device") or "?")


def _gpus(data: dict) -> int:
    """How many GPUs the run used (``environment.world_size``; 1 when not recorded)."""
    return int(_env(data).get("world_size") or 1)


def _short_device(data: dict, gpus: int | None = None) -> str:
    name = _device(data)
    gpus = _gpus(data) if gpus is None else gpus
    for short in ("H100", "H200"):
        if short in name:
            return f"{gpus}x {short}" if gpus > 1 else short
    return "CPU" if name in ("cpu", "x86_64", "?") or data.get("device") == "cpu" else name


def _long_device(data: dict, gpus: int | None = None) -> str:
    gpus = _gpus(data) if gpus is None else gpus
    return f"{gpus}x {_device(data)}" if gpus > 1 else _device(data)


def _date(data: dict) -> str:
    return str(_env(data).get("date") or data.get("date") or "?")[:10]


def _commit(data: dict) -> str:
    return str(data.get("commit") or _env(data).get("commit") or "?")


def _commits(data: dict) -> str:
    """The commit of a file, or of each of its runs."""
    runs = data.get("runs")
    if not runs:
        return f"`{_commit(data)}`"
    if isinstance(runs, dict):  # distributed_bench: one run per GPU count
        return ", ".join(f"`{_commit(run)}` ({gpus} GPU{'s' if gpus != '1' else ''})" for gpus, run in runs.items())
    return ", ".join(f"`{_commit(run)}` ({run['name']})" for run in runs)


def _run(data: dict, name: str) -> dict:
    return next(run for run in data.get("runs", []) if run["name"] == name)


def _table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _k(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1000:.1f}k"


def _rows(data: dict, **match: object) -> dict:
    return next(row for row in data["rows"] if all(row.get(key) == value for key, value in match.items()))


# ---------------------------------------------------------------------------------------------------------------
# The README's headline table: one row per result, short cells, ratios against the baseline of the same run.

_MODEL_NAMES = {"qwen3-0.6b": "Qwen3-0.6B shape", "qwen3-30b-a3b-4l": "Qwen3-30B-A3B shape (4 layers)",
                "mixtral-8x7b-2l": "Mixtral-8x7B shape (2 layers)", "gemma-3-4b-6l": "Gemma-3-4B shape (6 layers)",
                "llama-3.1-8b-4l": "Llama-3.1-8B shape (4 layers)"}
# models_bench results in the headline: (variant, baseline) pairs per file; the issue's targets are set this way.
_MODELS_HEADLINE = {"moe-h100": ("MoE training", (("kernelize", "eager"), ("kernelize_compile", "compile"))),
                    "gemma-h100": ("Training", (("kernelize", "compile"), ("kernelize_compile", "compile")))}
# distributed_bench variants in the headline, with the baseline each is compared with.
_DISTRIBUTED_HEADLINE = (("kernelize_before", "kernelize, then `fully_shard`", "eager"),
                         ("kernelize_compile", "kernelize + compile, then `fully_shard`", "`torch.compile`"))


def _trainer_numbers(data: dict) -> tuple[dict[str, float], dict[str, float]]:
    """Steady tokens/s and peak GiB (per GPU) of every variant of a trainer_bench file that did not fail."""
    r = {name: v for name, v in data["results"].items() if "error" not in v}
    return ({name: v["steady_tokens_per_second"] for name, v in r.items()},
            {name: v["peak_memory_gib"] for name, v in r.items()})


def _per_gpu(gpus: int) -> str:
    return "/GPU" if gpus > 1 else ""


def _gpu_counts(data: dict) -> list[str]:
    """The GPU counts of a distributed_bench scaling file (its ``runs`` keys), smallest first."""
    return sorted(data.get("runs") or {}, key=int)


def headline_rows(results: dict[str, dict]) -> list[dict]:
    """Headline results as dicts: what, device, against, speed, memory, commit, file (and ``ratio`` for the chart).

    ``speed`` is the throughput ratio (tokens/s, or ms per token inverted), ``memory`` the peak-memory ratio;
    both against the named baseline measured in the same run. Benchmarks whose files are missing are skipped.
    """
    out: list[dict] = []

    def add(stem: str, what: str, against: str, ratio: float | None, speed: str, memory: str, commit: str, *,
            device: str | None = None, label: str | None = None) -> None:
        out.append({"what": what, "device": device or _short_device(results[stem]), "against": against,
                    "ratio": ratio, "speed": speed, "memory": memory, "commit": commit, "file": f"{stem}.json",
                    "label": label})

    if "trainer-qwen3-0.6b-h100" in results:
        stem = "trainer-qwen3-0.6b-h100"
        data = results[stem]
        r = data["results"]
        tok, peak = _trainer_numbers(data)
        c = r["kernelize"].get("commit") or _commit(data)
        c_compile = r["kernelize_compile"].get("commit") or _env(data).get("commit") or _commit(data)
        add(stem, "Trainer, Qwen3-0.6B shape: `KernelizeCallback`", "`use_liger_kernel=True`",
            tok["kernelize"] / tok["liger"],
            f"**{tok['kernelize'] / tok['liger']:.2f}x** ({_k(tok['kernelize'])} tok/s)",
            f"{peak['kernelize'] / peak['liger']:.2f}x ({peak['kernelize']:.1f} GiB)", c)
        add(stem, "Trainer + `torch_compile`: `KernelizeCallback`", "plain Trainer + `torch_compile`",
            tok["kernelize_compile"] / tok["plain_compile"],
            f"**{tok['kernelize_compile'] / tok['plain_compile']:.2f}x** ({_k(tok['kernelize_compile'])} tok/s)",
            f"{peak['kernelize_compile'] / peak['plain_compile']:.2f}x ({peak['kernelize_compile']:.1f} GiB)",
            c_compile)
    for stem, data in results.items():
        if not (stem.startswith("trainer-fsdp2-") and "results" in data):
            continue
        tok, peak = _trainer_numbers(data)
        if not {"plain", "liger", "kernelize"} <= tok.keys():
            continue
        each = _per_gpu(_gpus(data))
        add(stem, "Trainer under FSDP2, Qwen3-0.6B shape: `KernelizeCallback`",
            "plain Trainer / `use_liger_kernel=True`", tok["kernelize"] / tok["plain"],
            f"**{tok['kernelize'] / tok['plain']:.2f}x** / {tok['kernelize'] / tok['liger']:.2f}x "
            f"({_k(tok['kernelize'])} tok/s)",
            f"{peak['kernelize'] / peak['plain']:.2f}x / {peak['kernelize'] / peak['liger']:.2f}x "
            f"({peak['kernelize']:.1f} GiB{each})", _commit(data),
            label=f"Trainer under FSDP2, Qwen3-0.6B: KernelizeCallback ({_short_device(data)}) vs plain Trainer")
    for stem, data in results.items():
        if not stem.startswith("distributed-"):
            continue
        model = _MODEL_NAMES.get(data.get("model", ""), data.get("model", "?"))
        counts = _gpu_counts(data)
        if counts:  # one run per GPU count: each count's ratio, charted at the largest
            runs = [data["runs"][n] for n in counts]
            if not all("kernelize_before" in run.get("ratios_vs_eager", {}) for run in runs):
                continue
            ratios = [run["ratios_vs_eager"]["kernelize_before"] for run in runs]
            top = runs[-1]["variants"]["kernelize_before"]
            gpus = [f"{n} GPU{'s' if n != '1' else ''}" for n in counts]
            add(stem, f"FSDP2 training loop, {model}: kernelize, then `fully_shard`", "eager",
                ratios[-1].get("tokens_per_s"),
                ", ".join(f"{r['tokens_per_s']:.2f}x ({g})" for r, g in zip(ratios, gpus, strict=True)),
                ", ".join(f"{r['peak']:.2f}x" for r in ratios) + f" ({top['peak_GiB']:.1f} GiB/GPU)",
                _commit(data), device=" and ".join(f"{n}x" for n in counts) + f" {_short_device(data, 1)}",
                label=f"FSDP2 training loop, {_chart_name(model)}: kernelize, then fully_shard "
                      f"({counts[-1]}x {_short_device(data, 1)}) vs eager")
            continue
        variants = data.get("variants", {})
        for variant, label, against in _DISTRIBUTED_HEADLINE:
            ratio = data.get("ratios_vs_eager", {}).get(variant)
            if ratio is None or variant not in variants:
                continue
            bold = "**" if variant == "kernelize_before" else ""
            add(stem, f"FSDP2 training, {model}: {label}", against, ratio["tokens_per_s"],
                f"{bold}{ratio['tokens_per_s']:.2f}x{bold} ({_k(variants[variant]['tokens_per_s'])} tok/s)",
                f"{ratio['peak']:.2f}x ({variants[variant]['peak_GiB']:.1f} GiB/GPU)", _commit(data))
    for stem, (label, pairs) in _MODELS_HEADLINE.items():
        if stem not in results:
            continue
        data = results[stem]
        for model in dict.fromkeys(row["model"] for row in data["rows"]):
            by = {row["variant"]: row for row in data["rows"] if row["model"] == model and row.get("tokens_per_s")}
            for variant, base in pairs:
                if variant in by and base in by:
                    ratio = by[variant]["tokens_per_s"] / by[base]["tokens_per_s"]
                    add(stem, f"{label}, {_MODEL_NAMES.get(model, model)}: {variant.replace('_', ' + ')}",
                        "eager" if base == "eager" else "`torch.compile`", ratio,
                        f"**{ratio:.2f}x** ({_k(by[variant]['tokens_per_s'])} tok/s)",
                        f"{by[variant]['peak_GiB'] / by[base]['peak_GiB']:.2f}x ({by[variant]['peak_GiB']:.1f} GiB)",
                        _commit(data))
    for stem in ("qwen3-h100", "qwen3-h200"):
        if stem not in results:
            continue
        data = results[stem]
        by = {row["variant"]: row for row in _qwen3_rows(data)}
        if "torch_compile" not in by:
            continue
        compile_ = by["torch_compile"]
        for variant, label in (("kernelize", "kernelize"), ("kernelize_compile", "kernelize + compile")):
            if variant not in by:
                continue
            row = by[variant]
            ratio = row["train_tokens_per_s"] / compile_["train_tokens_per_s"]
            bold = "**" if variant == "kernelize_compile" else ""
            add(stem, f"Training loop, Qwen3-0.6B shape: {label}", "`torch.compile`", ratio,
                f"{bold}{ratio:.2f}x{bold} ({_k(row['train_tokens_per_s'])} tok/s)",
                f"{row['train_peak_GiB'] / compile_['train_peak_GiB']:.2f}x ({row['train_peak_GiB']:.1f} GiB)",
                _commit(data))
    if "decode-h100" in results:
        data = results["decode-h100"]
        rerun, prof = _run(data, "llama-dynamic-b1-rerun"), _run(data, "llama-profiled")
        b1 = _rows(rerun, variant="eager")["ms_per_token"] / _rows(rerun, variant="kernelize")["ms_per_token"]
        b8 = (_rows(prof, variant="eager", cache="dynamic", batch=8)["ms_per_token"]
              / _rows(prof, variant="kernelize", cache="dynamic", batch=8)["ms_per_token"])
        add("decode-h100", "Decoding, Llama-3.1-8B shape (4 layers), dynamic cache: kernelize", "eager",
            b1, f"{b1:.2f}x (batch 1), {b8:.2f}x (batch 8)", "-", f"{_commit(rerun)}, {_commit(prof)}")
        comp = _run(data, "llama-static-compile")
        ratios = [_rows(comp, variant="compile", batch=b)["ms_per_token"]
                  / _rows(comp, variant="kernelize_compile", batch=b)["ms_per_token"] for b in (1, 8)]
        add("decode-h100", "Decoding, same shape, static cache, compiled: kernelize + compile", "`torch.compile`",
            ratios[0], f"{ratios[0]:.2f}x (batch 1), {ratios[1]:.2f}x (batch 8)", "-", _commit(comp))
    for stem in ("portable-cpu",):
        if stem in results:
            data = results[stem]
            summary = data["variants"]["kernelized"]["summary"]
            speed = 1 / summary["time_ratio_vs_eager"]
            add(stem, "Portable kernels only (no vendor plugin), training step", "eager", speed, f"{speed:.2f}x",
                f"**{summary['peak_ratio_vs_eager']:.2f}x**", _commit(data))
    return out


def headline_table(results: dict[str, dict]) -> str:
    """The README's results table (Markdown)."""
    return _table(("result", "device", "against", "speed", "peak memory", "commit"),
                  ((row["what"], row["device"], row["against"], row["speed"], row["memory"],
                    f"[`{row['commit']}`](benchmarks/results/{row['file']})") for row in headline_rows(results)))


def _chart_name(text: str) -> str:
    """A headline cell shortened for a chart label: no markup, no "shape", no layer count."""
    return re.sub(r"(?<=B) shape| \(\d+ layers\)", "", text).replace("`", "")


def headline_chart(results: dict[str, dict]) -> str:
    """The README's one chart (SVG): speed of each headline result against its baseline."""
    values = [(row["label"] or f"{_chart_name(row['what'])} ({row['device']}) vs {_chart_name(row['against'])}",
               row["ratio"]) for row in headline_rows(results) if row["ratio"] is not None]
    return _bar_chart("Speed against the baseline measured in the same run (1.0 = as fast)", values, "x",
                      label_width=700, reference=1.0, digits=2)


def update_readme(results: dict[str, dict], readme: Path = README) -> str:
    """README text with the table between its markers regenerated."""
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: markers {START} and {END} not found")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{headline_table(results)}\n{END}{tail}"


# ---------------------------------------------------------------------------------------------------------------
# The docs site's benchmarks page.

def _qwen3_rows(data: dict) -> list[dict]:
    return [row for row in data.get("rows", []) if "train_tokens_per_s" in row]


def summary_table(results: dict[str, dict]) -> str:
    """Model-level results: one row per benchmark, device and variant, ratios against eager PyTorch in the same run."""
    rows = []

    def add(what: str, device: str, speed: float, peak: float, stem: str) -> None:
        rows.append((what, device, f"{speed:.2f}x", f"{peak:.2f}x", f"`{stem}.json`"))

    for stem, data in results.items():
        if stem.startswith("trainer-") and "results" in data:
            tok, peak = _trainer_numbers(data)
            for variant in ("kernelize", "kernelize_compile"):
                if variant in tok and "plain" in tok:
                    add(f"Trainer, Qwen3-0.6B shape, `{variant}`", _long_device(data), tok[variant] / tok["plain"],
                        peak[variant] / peak["plain"], stem)
        elif stem.startswith("distributed-"):
            model = _MODEL_NAMES.get(data.get("model", ""), data.get("model", "?"))
            runs = [(int(n), data["runs"][n]) for n in _gpu_counts(data)] or [(_gpus(data), data)]
            for gpus, run in runs:
                v = run.get("variants", {})
                if "eager" not in v:
                    continue
                for variant in ("kernelize_before", "kernelize_after", "kernelize_compile"):
                    if variant in v:
                        add(f"FSDP2 training, {model}, `{variant}`", _long_device(data, gpus),
                            v[variant]["tokens_per_s"] / v["eager"]["tokens_per_s"],
                            v[variant]["peak_GiB"] / v["eager"]["peak_GiB"], stem)
        elif stem in _MODELS_HEADLINE:
            for model in dict.fromkeys(row["model"] for row in data["rows"]):
                by = {r["variant"]: r for r in data["rows"] if r["model"] == model and r.get("tokens_per_s")}
                for variant in ("kernelize", "kernelize_compile"):
                    if variant in by and "eager" in by:
                        add(f"{_MODEL_NAMES.get(model, model)} training, `{variant}`", _long_device(data),
                            by[variant]["tokens_per_s"] / by["eager"]["tokens_per_s"],
                            by[variant]["peak_GiB"] / by["eager"]["peak_GiB"], stem)
        elif stem.startswith("qwen3-") and any(r["variant"] == "eager" for r in _qwen3_rows(data)):
            by = {r["variant"]: r for r in _qwen3_rows(data)}
            eager = by["eager"]
            for variant in ("kernelize", "kernelize_compile"):
                if variant in by:
                    r = by[variant]
                    add(f"Qwen3-0.6B shape training loop, `{variant}`", _long_device(data),
                        r["train_tokens_per_s"] / eager["train_tokens_per_s"],
                        r["train_peak_GiB"] / eager["train_peak_GiB"], stem)
        elif stem.startswith("portable-") and "variants" in data:
            v = data["variants"]
            if "eager" in v and "kernelized" in v:
                add("portable kernels only, training step", _long_device(data),
                    _median(v["eager"]["step_seconds"]) / _median(v["kernelized"]["step_seconds"]),
                    v["kernelized"]["peak_bytes"] / v["eager"]["peak_bytes"], stem)
    return _table(("what", "device", "throughput vs eager", "peak memory vs eager", "results file"), rows)


def _bar_chart(title: str, values: list[tuple[str, float]], unit: str, *, label_width: int = 210,
               reference: float | None = None, digits: int = 1) -> str:
    """A horizontal bar chart as standalone SVG (no plotting library needed)."""
    bar, gap, plot = 22, 8, 330
    width = label_width + plot + 90
    top = max([value for _, value in values] + [reference or 0.0]) or 1.0
    height = 40 + len(values) * (bar + gap)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="13"><rect width="100%" height="100%" fill="white"/>'
             f'<text x="4" y="18" font-weight="bold">{_xml(title)}</text>']
    for i, (label, value) in enumerate(values):
        y = 30 + i * (bar + gap)
        length = plot * value / top
        color = "#3f51b5" if reference is None or value >= reference else "#e57373"
        parts.append(f'<text x="4" y="{y + 16}">{_xml(label)}</text>'
                     f'<rect x="{label_width}" y="{y}" width="{length:.1f}" height="{bar}" fill="{color}"/>'
                     f'<text x="{label_width + length + 6:.1f}" y="{y + 16}">{value:,.{digits}f}{unit}</text>')
    if reference is not None:
        x = label_width + plot * reference / top
        parts.append(f'<line x1="{x:.1f}" y1="26" x2="{x:.1f}" y2="{height - 6}" stroke="black" '
                     f'stroke-dasharray="4 3"/>')
    return "\n".join(parts) + "\n</svg>\n"


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def charts(results: dict[str, dict]) -> dict[str, str]:
    """SVG charts for the benchmarks page, by file name."""
    out = {}
    if results:
        out[CHART.name] = headline_chart(results)
    for stem, data in results.items():
        rows = _qwen3_rows(data)
        if stem.startswith("qwen3-") and len(rows) > 1:
            out[f"{stem}-throughput.svg"] = _bar_chart(
                f"{stem}: training tokens/s", [(r["variant"], r["train_tokens_per_s"] / 1000) for r in rows], "k")
            out[f"{stem}-memory.svg"] = _bar_chart(
                f"{stem}: training peak memory", [(r["variant"], r["train_peak_GiB"]) for r in rows], " GiB")
        elif stem.startswith("trainer-") and "results" in data:
            tok, _ = _trainer_numbers(data)
            out[f"{stem}.svg"] = _bar_chart(
                f"Trainer, Qwen3-0.6B shape, {_short_device(data)}: steady tokens/s",
                [(name, value / 1000) for name, value in tok.items()], "k")
        elif stem.startswith("distributed-"):
            counts = _gpu_counts(data)
            runs = [(int(n), data["runs"][n]) for n in counts] or [(_gpus(data), data)]
            values = [(f"{gpus} GPU{'s' if gpus > 1 else ''}: {name}", row["tokens_per_s"] / gpus / 1000)
                      for gpus, run in runs for name, row in run.get("variants", {}).items()
                      if row.get("tokens_per_s")]
            out[f"{stem}.svg"] = _bar_chart(f"FSDP2, {_short_device(data, 1)}: tokens/s per GPU", values, "k",
                                            label_width=260)
    for stem in ("moe-h100", "gemma-h100"):
        if stem in results:
            rows = [(f"{row['model']} {row['variant']}", row["tokens_per_s"] / 1000)
                    for row in results[stem]["rows"] if row.get("tokens_per_s")]
            out[f"{stem}.svg"] = _bar_chart(f"{_models_title(results[stem])[:60]}, H100: tokens/s", rows, "k",
                                            label_width=300)
    if "decode-h100" in results:
        rows = [(f"{row['model']} {row['cache']} b{row['batch']} {row['variant']}", row["ms_per_token"])
                for run in results["decode-h100"]["runs"] if run["name"] != "llama-profiled"
                for row in run["rows"]]
        rows += [(f"{row['model']} {row['cache']} b{row['batch']} {row['variant']}", row["ms_per_token"])
                 for row in _run(results["decode-h100"], "llama-profiled")["rows"]]
        out["decode-h100.svg"] = _bar_chart("Decoding, H100: ms per token (shorter is faster)", rows, " ms",
                                            label_width=330, digits=2)
    return out


def _trainer_section(stem: str, data: dict, chart_dir: str | None) -> list[str]:
    gpus = _gpus(data)
    rows = []
    for name, v in data["results"].items():
        if "error" in v:
            rows.append((f"`{name}`", "failed", "-", "-", v["error"].strip().splitlines()[-1][:80]))
            continue
        rows.append((f"`{name}`", f"{v['steady_tokens_per_second']:,.0f}", f"{v['train_tokens_per_second']:,.0f}",
                     f"{v['peak_memory_gib']:.2f}", "-"))
    summary = {key: value for key, value in data.get("summary", {}).items() if value is not None}
    where = f"one `torchrun` of {gpus} processes per variant" if gpus > 1 else "one process per variant"
    parts = [f"## Trainer, Qwen3-0.6B shape, {_short_device(data)} (`{stem}.json`)", "",
             f"{data.get('shape', '')}; {data.get('steps')} steps, {data.get('warmup_steps')} warm-up; "
             f"{_long_device(data)}, commit `{_commit(data)}`. `benchmarks/cuda/trainer_bench.py`, {where}. "
             "Steady tokens/s leaves out the warm-up steps (and compilation); the Trainer's own figure "
             "includes them." + (" Tokens/s count every GPU; peak memory is the largest of the GPUs'."
                                 if gpus > 1 else ""),
             "", _table(("variant", "steady tokens/s", "Trainer tokens/s", "peak GiB" + (" per GPU" if gpus > 1
                                                                                            else ""), "error"),
                        rows), ""]
    if summary:
        parts += [_table(("ratio", "value"), ((f"`{key}`", f"{value:.3g}") for key, value in summary.items())), ""]
    if chart_dir is not None:
        parts += [f"![{stem}]({chart_dir}/{stem}.svg)", ""]
    return parts


def _loss_diff(data: dict, variant: str) -> str:
    ratio = data.get("ratios_vs_eager", {}).get(variant)
    if not ratio or ratio.get("max_rel_loss_diff") is None:
        return "-"
    return f"{ratio['max_rel_loss_diff']:.1e} ({ratio['vs']})"


def _distributed_section(stem: str, data: dict, chart_dir: str | None) -> list[str]:
    model = _MODEL_NAMES.get(data.get("model", ""), data.get("model", "?"))
    counts = _gpu_counts(data)
    runs = [(int(n), data["runs"][n]) for n in counts] or [(_gpus(data), data)]
    where = " and ".join(str(gpus) for gpus, _ in runs) + f" {_short_device(data, 1)}s"
    parts = [f"## FSDP2 training, {model}, {where} (`{stem}.json`)", "",
             f"{data.get('config', '')}; {data.get('steps_timed')} timed steps after {data.get('steps_warmup')} "
             f"warm-up; {_device(data)}, commit `{_commit(data)}`. `benchmarks/cuda/distributed_bench.py`, one "
             "`torchrun` job per GPU count running the variants one after the other from the same seeds and data. "
             "Tokens/s count every GPU; peak memory is per GPU; the loss "
             "column is the largest relative difference from the baseline's loss (mean over ranks) at any step.", ""]
    table = []
    for gpus, run in runs:
        v = run.get("variants", {})
        for name, row in v.items():
            vs = {base: f"{row['tokens_per_s'] / v[base]['tokens_per_s']:.2f}x" if base in v else "-"
                  for base in ("eager", "compile")}
            table.append((gpus, f"`{name}`", f"{row['tokens_per_s']:,.0f}", f"{row['tokens_per_s'] / gpus:,.0f}",
                          vs["eager"], vs["compile"], f"{row['peak_GiB']:.1f}",
                          f"{row['first_step_s']:.1f}" if row.get("first_step_s") is not None else "-",
                          _loss_diff(run, name)))
    header = ["GPUs", "variant", "tokens/s", "per GPU", "vs eager", "vs compile", "peak GiB per GPU",
              "first step s", "loss diff (vs)"]
    if not any(row[5] != "-" for row in table):  # no compile variant: drop its column
        header.pop(5)
        table = [row[:5] + row[6:] for row in table]
    parts += [_table(header, table), ""]
    scaling = data.get("scaling") or {}
    if scaling and len(counts) > 1:
        parts += [f"Tokens/s per GPU, and their ratio to the {counts[0]}-GPU figure (scaling efficiency):", "",
                  _table(["variant", *(f"{n} GPU{'s' if n != '1' else ''}" for n in counts), "efficiency"],
                         ((f"`{name}`", *(f"{s['tokens_per_s_per_gpu'][n]:,}" for n in counts),
                           ", ".join(f"{s['efficiency'][n]:.2f} ({n} GPUs)" for n in counts[1:]))
                          for name, s in scaling.items())), ""]
        first, last = data["runs"][counts[0]], data["runs"][counts[-1]]
        if {"eager", "kernelize_before"} <= scaling.keys() and "kernelize_before" in last.get("ratios_vs_eager", {}):
            k_eff = scaling["kernelize_before"]["efficiency"][counts[-1]]
            e_eff = scaling["eager"]["efficiency"][counts[-1]]
            note = (f"Kernelized before `fully_shard`, the model runs "
                    f"{first['ratios_vs_eager']['kernelize_before']['tokens_per_s']:.2f}x eager on {counts[0]} GPU "
                    f"and {last['ratios_vs_eager']['kernelize_before']['tokens_per_s']:.2f}x on {counts[-1]}: per "
                    f"GPU it keeps {k_eff:.2f} of its {counts[0]}-GPU throughput, eager {e_eff:.2f}.")
            if k_eff < e_eff:
                note += (" Why is not yet profiled; the likely causes are FSDP2's per-layer communication and "
                         "host-side work, which eager's longer compute hides, and the fused loss's host "
                         "synchronisation (Liger's forward reads the number of labelled tokens with `.item()` once "
                         "per step), which keeps the CPU from queueing ahead.")
            parts += [note, ""]
    if chart_dir is not None:
        parts += [f"![{stem}]({chart_dir}/{stem}.svg)", ""]
    return parts


def _models_title(data: dict) -> str:
    if data.get("what"):
        return str(data["what"])
    models = dict.fromkeys(_MODEL_NAMES.get(row["model"], row["model"]) for row in data.get("rows", []))
    return "Training, " + ", ".join(models) + ", one process per variant"


def _profile_split(profile: list[dict]) -> tuple[float, float, float]:
    """GPU ms of one profiled step: all kernels, the grouped expert GEMMs (CUTLASS grouped problems), fused AdamW."""
    total = next((k["gpu_ms"] for k in profile if k["kernel"] == "<all kernels>"), None)
    kernels = [k for k in profile if k["kernel"] != "<all kernels>"]
    if total is None:
        total = sum(k["gpu_ms"] for k in kernels)
    grouped = sum(k["gpu_ms"] for k in kernels if "GroupProblem" in k["kernel"])
    adamw = sum(k["gpu_ms"] for k in kernels if "FusedOptimizer" in k["kernel"])
    return total, grouped, adamw


def _models_section(stem: str, data: dict, chart_dir: str | None) -> list[str]:
    parts = [f"## {_models_title(data)} (`{stem}.json`)", "",
             f"{_device(data)}, commit `{_commit(data)}`; {data.get('config', '')}. "
             f"`benchmarks/cuda/models_bench.py`. {data.get('note', '')}".rstrip(), "",
             _table(("model", "variant", "tokens/s", "vs eager", "vs compile", "peak GiB", "first step s"),
                    ((row["model"], f"`{row['variant']}`", f"{row['tokens_per_s']:,}" if row.get("tokens_per_s")
                      else "failed: " + (row.get("error") or row.get("process_error") or "?")[:60],
                      row.get("speed_vs_eager", "-"), row.get("speed_vs_compile", "-"),
                      f"{row['peak_GiB']:.1f}" if row.get("peak_GiB") else "-",
                      f"{row['first_step_s']:.1f}" if row.get("first_step_s") else "-") for row in data["rows"])), ""]
    # Only where there are expert GEMMs to set apart (MoE shapes).
    profiled = [row for row in data["rows"] if row.get("profile_one_step")
                and any("GroupProblem" in k["kernel"] for k in row["profile_one_step"])]
    if profiled:
        split = {id(row): _profile_split(row["profile_one_step"]) for row in profiled}
        parts += ["GPU time of one profiled step (ms), per kernel group:", "",
                  _table(("model", "variant", "all kernels", "grouped expert GEMMs", "fused AdamW", "share of both"),
                         ((row["model"], f"`{row['variant']}`", f"{total:.1f}", f"{grouped:.1f}", f"{adamw:.1f}",
                           f"{(grouped + adamw) / total:.0%}")
                          for row in profiled for total, grouped, adamw in [split[id(row)]])), ""]
        for model in dict.fromkeys(row["model"] for row in profiled):
            fixed = [split[id(row)] for row in profiled if row["model"] == model]
            both = [grouped + adamw for _, grouped, adamw in fixed]
            shares = [(grouped + adamw) / total for total, grouped, adamw in fixed]
            if len(both) > 1 and max(both) / min(both) < 1.1:
                parts += [f"{_MODEL_NAMES.get(model, model)}: the grouped expert GEMMs and the fused AdamW take "
                          f"{min(both):.0f}-{max(both):.0f} ms in every variant, {min(shares):.0%}-{max(shares):.0%} "
                          "of the step's GPU time; the variants differ in the rest.", ""]
    if chart_dir is not None:
        parts += [f"![{stem}]({chart_dir}/{stem}.svg)", ""]
    return parts


def _decode_section(data: dict, chart_dir: str | None) -> list[str]:
    parts = ["## Decoding (`decode-h100.json`)", "", f"{data.get('what', '')}.", ""]
    for run in data["runs"]:
        parts += [f"**{run['name']}**: {_device(run)}, commit `{_commit(run)}`; {run.get('config', '')}.", "",
                  _table(("model", "cache", "batch", "variant", "ms/token", "vs baseline"),
                         ((row["model"], row["cache"], row["batch"], f"`{row['variant']}`",
                           f"{row['ms_per_token']:.2f}",
                           row.get("speed_vs_eager", row.get("speed_vs_compile", "-"))) for row in run["rows"])), ""]
    if chart_dir is not None:
        parts += [f"![decode]({chart_dir}/decode-h100.svg)", ""]
    return parts


def page(results: dict[str, dict], *, chart_dir: str | None = None) -> str:
    """The benchmarks page: headline, per-benchmark tables, charts, and an inventory of every results file."""
    parts = ["# Benchmarks", "",
             "<!-- Generated by `python benchmarks/report.py --write`; edit the results files or report.py. -->", "",
             "Generated by `benchmarks/report.py` from `benchmarks/results/*.json`. Variants of a benchmark are "
             "measured side by side in one run on one machine, each in its own process "
             "(`distributed_bench.py`: one after the other in one `torchrun` job); ratios are against the baseline "
             "of that run.", "", "## Headline", "",
             _table(("result", "device", "against", "speed", "peak memory", "commit", "file"),
                    ((r["what"], r["device"], r["against"], r["speed"], r["memory"], f"`{r['commit']}`",
                      f"`{r['file']}`") for r in headline_rows(results))), ""]
    if chart_dir is not None and results:
        parts += [f"![headline]({chart_dir}/{CHART.name})", ""]
    parts += ["## Against eager PyTorch", "", summary_table(results), ""]
    for stem, data in results.items():
        if stem.startswith("trainer-") and "results" in data:
            parts += _trainer_section(stem, data, chart_dir)
    for stem, data in results.items():
        if stem.startswith("distributed-") and (data.get("runs") or data.get("variants")):
            parts += _distributed_section(stem, data, chart_dir)
    for stem in ("moe-h100", "gemma-h100"):
        if stem in results:
            parts += _models_section(stem, results[stem], chart_dir)
    if "decode-h100" in results:
        parts += _decode_section(results["decode-h100"], chart_dir)
    for stem, data in results.items():
        rows = _qwen3_rows(data)
        if stem.startswith("qwen3-") and rows:
            parts += [f"## Training loop, Qwen3-0.6B shape, {_short_device(data)} (`{stem}.json`)", "",
                      f"{data.get('config', '')}; {_device(data)}, {_date(data)}, commit `{_commit(data)}`. "
                      "`benchmarks/cuda/qwen3_bench.py`.", "",
                      _table(("variant", "train tokens/s", "train peak GiB", "prefill ms"),
                             ((r["variant"], f"{r['train_tokens_per_s']:,.0f}", f"{r['train_peak_GiB']:.1f}",
                               f"{r['prefill_ms']:.1f}" if r.get("prefill_ms") is not None else "-")
                              for r in rows)), ""]
            if chart_dir is not None and len(rows) > 1:
                parts += [f"![{stem} throughput]({chart_dir}/{stem}-throughput.svg)",
                          f"![{stem} memory]({chart_dir}/{stem}-memory.svg)", ""]
    parts += ["## Every results file", "",
              _table(("file", "device", "date", "commit"),
                     ((f"`{stem}.json`", _long_device(data), _date(data), _commits(data))
                      for stem, data in results.items())), ""]
    return "\n".join(parts)


def generated(results: dict[str, dict]) -> dict[Path, str]:
    """Every file ``--write`` produces, with its content: the README, the benchmarks page and its charts."""
    files = {README: update_readme(results), PAGE: page(results, chart_dir="assets")}
    files.update({ASSETS / name: svg for name, svg in charts(results).items()})
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of results JSON files")
    parser.add_argument("--table", action="store_true", help="print only the README's results table")
    parser.add_argument("--write", action="store_true", help="regenerate the README's table, the docs page, charts")
    parser.add_argument("--check", action="store_true", help="exit 1 if any file --write makes is out of date")
    parser.add_argument("--out", type=Path, help="write the page here instead of stdout")
    parser.add_argument("--charts", type=Path, help="write SVG charts into this folder and link them")
    args = parser.parse_args(argv)
    results = load_results(args.results)
    if args.table:
        print(headline_table(results))
        return 0
    if args.write or args.check:
        wanted = generated(results)
        stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
        if args.check:
            for path in stale:
                print(f"{path.relative_to(ROOT)} is out of date: run python benchmarks/report.py --write",
                      file=sys.stderr)
            return 1 if stale else 0
        for path in stale:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted[path])
        return 0
    chart_link = None
    if args.charts:
        args.charts.mkdir(parents=True, exist_ok=True)
        for name, svg in charts(results).items():
            (args.charts / name).write_text(svg)
        chart_link = args.charts.name
    text = page(results, chart_dir=chart_link)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
