"""Tables and charts from ``benchmarks/results/*.json``: the one source of the published benchmark numbers.

The documentation site's benchmarks page and the README's results table both come from here, so a number
changes in one place: the results file.

    python benchmarks/report.py                   # the whole benchmarks page (Markdown) on stdout
    python benchmarks/report.py --table           # only the model-level summary table (the README's)
    python benchmarks/report.py --out docs-page.md --charts charts/   # page to a file, SVG charts beside it

Each results file is named ``<benchmark>-<device>.json`` and states the commit that recorded it (``commit``).
Files this script has no table for are still listed in the inventory with their device, date and commit.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path


__all__ = ["load_results", "page", "summary_table"]

RESULTS = Path(__file__).resolve().parent / "results"


def load_results(folder: Path = RESULTS) -> dict[str, dict]:
    """Every ``*.json`` under ``folder``, by file stem (``qwen3-h200``)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def _device(data: dict) -> str:
    env = data.get("environment") or {}
    return str(env.get("device") or data.get("device_name") or data.get("machine") or data.get("device") or "?")


def _date(data: dict) -> str:
    env = data.get("environment") or {}
    return str(env.get("date") or data.get("date") or "?")[:10]


def _table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _qwen3_rows(data: dict) -> list[dict]:
    return [row for row in data.get("rows", []) if "train_tokens_per_s" in row]


def summary_table(results: dict[str, dict]) -> str:
    """Model-level results: one row per benchmark and device, ratios against eager PyTorch in the same run."""
    rows = []
    for stem, data in results.items():
        if stem.startswith("qwen3-") and _qwen3_rows(data) and any(r["variant"] == "eager" for r in _qwen3_rows(data)):
            by = {r["variant"]: r for r in _qwen3_rows(data)}
            eager = by["eager"]
            for variant in ("kernelize", "kernelize_compile"):
                if variant in by:
                    r = by[variant]
                    rows.append((f"Qwen3-0.6B shape training, `{variant}`", _device(data),
                                 f"{r['train_tokens_per_s'] / eager['train_tokens_per_s']:.2f}x",
                                 f"{r['train_peak_GiB'] / eager['train_peak_GiB']:.2f}x", f"`{stem}.json`"))
        elif stem.startswith("portable-") and "variants" in data:
            v = data["variants"]
            if "eager" in v and "kernelized" in v:
                time_ratio = _median(v["eager"]["step_seconds"]) / _median(v["kernelized"]["step_seconds"])
                peak = v["kernelized"]["peak_bytes"] / v["eager"]["peak_bytes"]
                rows.append(("portable kernels only, training step", _device(data), f"{time_ratio:.2f}x",
                             f"{peak:.2f}x", f"`{stem}.json`"))
        elif stem.startswith("distributed-") and "ratios_vs_eager" in data:
            for variant, ratio in data["ratios_vs_eager"].items():
                rows.append((f"FSDP2/DDP training, `{variant}` vs `{ratio['vs']}`", f"2x {_device(data)}",
                             f"{ratio['tokens_per_s']:.2f}x", f"{ratio['peak']:.2f}x", f"`{stem}.json`"))
    return _table(("what", "device", "throughput vs eager", "peak memory vs eager", "results file"), rows)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _bar_chart(title: str, values: list[tuple[str, float]], unit: str) -> str:
    """A horizontal bar chart as standalone SVG (no plotting library needed)."""
    width, bar, gap, label_w = 640, 22, 8, 190
    top = max(value for _, value in values) or 1.0
    height = 34 + len(values) * (bar + gap)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="13"><text x="4" y="18" font-weight="bold">{title}</text>']
    for i, (label, value) in enumerate(values):
        y = 30 + i * (bar + gap)
        length = (width - label_w - 90) * value / top
        parts.append(f'<text x="4" y="{y + 16}">{label}</text>'
                     f'<rect x="{label_w}" y="{y}" width="{length:.1f}" height="{bar}" fill="#3f51b5"/>'
                     f'<text x="{label_w + length + 6:.1f}" y="{y + 16}">{value:,.1f} {unit}</text>')
    return "\n".join(parts) + "\n</svg>\n"


def charts(results: dict[str, dict]) -> dict[str, str]:
    """SVG charts by file name: training throughput and peak memory per variant for each Qwen3 run."""
    out = {}
    for stem, data in results.items():
        rows = _qwen3_rows(data)
        if stem.startswith("qwen3-") and len(rows) > 1:
            out[f"{stem}-throughput.svg"] = _bar_chart(
                f"{stem}: training tokens/s", [(r["variant"], r["train_tokens_per_s"] / 1000) for r in rows], "k")
            out[f"{stem}-memory.svg"] = _bar_chart(
                f"{stem}: training peak memory", [(r["variant"], r["train_peak_GiB"]) for r in rows], "GiB")
    return out


def page(results: dict[str, dict], *, chart_dir: str | None = None) -> str:
    """The benchmarks page: summary, per-run tables, charts, and an inventory of every results file."""
    parts = ["# Benchmarks", "",
             "Generated by `benchmarks/report.py` from `benchmarks/results/*.json`. Variants of a benchmark are "
             "measured side by side in one run on one machine; ratios are against eager PyTorch in that run.", "",
             "## Model level", "", summary_table(results), ""]
    for stem, data in results.items():
        rows = _qwen3_rows(data)
        if stem.startswith("qwen3-") and rows:
            parts += [f"## `{stem}`", "", f"{data.get('config', '')}; {_device(data)}, {_date(data)}, "
                      f"commit `{data.get('commit', '?')}`.", "",
                      _table(("variant", "train tokens/s", "train peak GiB", "prefill ms"),
                             ((r["variant"], f"{r['train_tokens_per_s']:,.0f}", f"{r['train_peak_GiB']:.1f}",
                               f"{r['prefill_ms']:.1f}" if r.get("prefill_ms") is not None else "-")
                              for r in rows)), ""]
            if chart_dir is not None and len(rows) > 1:
                parts += [f"![{stem} throughput]({chart_dir}/{stem}-throughput.svg)",
                          f"![{stem} memory]({chart_dir}/{stem}-memory.svg)", ""]
    parts += ["## Every results file", "",
              _table(("file", "device", "date", "commit"),
                     ((f"`{stem}.json`", _device(data), _date(data), f"`{data.get('commit', '?')}`")
                      for stem, data in results.items())), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of results JSON files")
    parser.add_argument("--table", action="store_true", help="print only the model-level summary table")
    parser.add_argument("--out", type=Path, help="write the page here instead of stdout")
    parser.add_argument("--charts", type=Path, help="write SVG charts into this folder and link them")
    args = parser.parse_args(argv)
    results = load_results(args.results)
    if args.table:
        print(summary_table(results))
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
