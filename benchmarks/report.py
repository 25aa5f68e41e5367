"""Tables and charts from ``benchmarks/results/*.json``: the one source of the published benchmark numbers.

The README's results table and chart, and the documentation site's benchmarks page, all come from here, so a
number changes in one place: the results file.

    python benchmarks/report.py --write           # README table (between its markers), docs/benchmarks.md, charts
    python benchmarks/report.py --check           # exit 1 if any of those is out of date (the docs build runs it)
    python benchmarks/report.py --table           # the README's table on stdout
    python benchmarks/report.py                   # the whole benchmarks page (Markdown) on stdout
    python benchmarks/report.py --out page.md --charts charts/   # page to a file, its SVG charts beside it

Each results file is named ``<benchmark>-<device>.json`` and states the commit that recorded it (``commit``, or
``environment.commit``). A file holding several runs keeps them under ``runs``, each with its own environment.
Files this script has no table for are still listed in the inventory with their device, date and commit.
"""

from __future__ import annotations

import argparse
import json
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


def _short_device(data: dict) -> str:
    name = _device(data)
    for short in ("H100", "H200"):
        if short in name:
            return short
    return "CPU" if name in ("cpu", "x86_64", "?") or data.get("device") == "cpu" else name


def _date(data: dict) -> str:
    return str(_env(data).get("date") or data.get("date") or "?")[:10]


def _commit(data: dict) -> str:
    return str(data.get("commit") or _env(data).get("commit") or "?")


def _commits(data: dict) -> str:
    """The commit of a file, or of each of its runs."""
    runs = data.get("runs")
    if not runs:
        return f"`{_commit(data)}`"
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

_MODEL_NAMES = {"qwen3-30b-a3b-4l": "Qwen3-30B-A3B shape (4 layers)",
                "mixtral-8x7b-2l": "Mixtral-8x7B shape (2 layers)", "gemma-3-4b-6l": "Gemma-3-4B shape (6 layers)",
                "llama-3.1-8b-4l": "Llama-3.1-8B shape (4 layers)"}
# models_bench results in the headline: (variant, baseline) pairs per file; the targets are set this way.
_MODELS_HEADLINE = {"moe-h100": ("MoE training", (("kernelize", "eager"), ("kernelize_compile", "compile"))),
                    "gemma-h100": ("Training", (("kernelize", "compile"), ("kernelize_compile", "compile")))}


def headline_rows(results: dict[str, dict]) -> list[dict]:
    """Headline results as dicts: what, device, against, speed, memory, commit, file (and ``ratio`` for the chart).

    ``speed`` is the throughput ratio (tokens/s, or ms per token inverted), ``memory`` the peak-memory ratio;
    both against the named baseline measured in the same run. Benchmarks whose files are missing are skipped.
    """
    out: list[dict] = []

    def add(stem: str, what: str, against: str, ratio: float | None, speed: str, memory: str, commit: str) -> None:
        out.append({"what": what, "device": _short_device(results[stem]), "against": against, "ratio": ratio,
                    "speed": speed, "memory": memory, "commit": commit, "file": f"{stem}.json"})

    if "trainer-qwen3-0.6b-h100" in results:
        data = results["trainer-qwen3-0.6b-h100"]
        r = data["results"]
        tok = {name: v.get("steady_tokens_per_second") for name, v in r.items()}
        peak = {name: v.get("peak_memory_gib") for name, v in r.items()}
        stem = "trainer-qwen3-0.6b-h100"
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
    if "qwen3-h200" in results:
        data = results["qwen3-h200"]
        by = {row["variant"]: row for row in data["rows"]}
        compile_ = by["torch_compile"]
        for variant, label in (("kernelize", "kernelize"), ("kernelize_compile", "kernelize + compile")):
            row = by[variant]
            ratio = row["train_tokens_per_s"] / compile_["train_tokens_per_s"]
            add("qwen3-h200", f"Training loop, Qwen3-0.6B shape: {label}", "`torch.compile`", ratio,
                f"{'**' if variant == 'kernelize_compile' else ''}{ratio:.2f}x"
                f"{'**' if variant == 'kernelize_compile' else ''} ({_k(row['train_tokens_per_s'])} tok/s)",
                f"{row['train_peak_GiB'] / compile_['train_peak_GiB']:.2f}x ({row['train_peak_GiB']:.1f} GiB)",
                _commit(data))
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


def headline_chart(results: dict[str, dict]) -> str:
    """The README's one chart (SVG): speed of each headline result against its baseline."""
    values = [(f"{row['what'].split(':')[0]} ({row['device']}) vs {row['against'].replace('`', '')}", row["ratio"])
              for row in headline_rows(results) if row["ratio"] is not None]
    return _bar_chart("Speed against the baseline measured in the same run (1.0 = as fast)", values, "x",
                      label_width=560, reference=1.0, digits=2)


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
    if "trainer-qwen3-0.6b-h100" in results:
        r = results["trainer-qwen3-0.6b-h100"]["results"]
        out["trainer-qwen3-0.6b-h100.svg"] = _bar_chart(
            "Trainer, Qwen3-0.6B shape, H100: steady tokens/s",
            [(name, v["steady_tokens_per_second"] / 1000) for name, v in r.items() if "error" not in v], "k")
    for stem in ("moe-h100", "gemma-h100"):
        if stem in results:
            rows = [(f"{row['model']} {row['variant']}", row["tokens_per_s"] / 1000)
                    for row in results[stem]["rows"] if row.get("tokens_per_s")]
            out[f"{stem}.svg"] = _bar_chart(f"{results[stem].get('what', stem)[:60]}, H100: tokens/s", rows, "k",
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


def _trainer_section(data: dict, chart_dir: str | None) -> list[str]:
    r = data["results"]
    rows = []
    for name, v in r.items():
        if "error" in v:
            rows.append((f"`{name}`", "failed", "-", "-", v["error"].strip().splitlines()[-1][:80]))
            continue
        rows.append((f"`{name}`", f"{v['steady_tokens_per_second']:,.0f}", f"{v['train_tokens_per_second']:,.0f}",
                     f"{v['peak_memory_gib']:.2f}", "-"))
    summary = data.get("summary", {})
    parts = ["## Trainer, Qwen3-0.6B shape (`trainer-qwen3-0.6b-h100.json`)", "",
             f"{data.get('shape', '')}; {data.get('steps')} steps, {data.get('warmup_steps')} warm-up; "
             f"{_device(data)}, commit `{_commit(data)}`. `benchmarks/cuda/trainer_bench.py`, one process per "
             "variant. Steady tokens/s leaves out the warm-up steps (and compilation); the Trainer's own figure "
             "includes them.",
             "", _table(("variant", "steady tokens/s", "Trainer tokens/s", "peak GiB", "error"), rows), ""]
    if summary:
        parts += [_table(("ratio", "value"), ((f"`{key}`", f"{value:.3g}") for key, value in summary.items())), ""]
    if chart_dir is not None:
        parts += [f"![trainer]({chart_dir}/trainer-qwen3-0.6b-h100.svg)", ""]
    return parts


def _models_section(stem: str, data: dict, chart_dir: str | None) -> list[str]:
    parts = [f"## {data.get('what', stem)} (`{stem}.json`)", "",
             f"{_device(data)}, commit `{_commit(data)}`; {data.get('config', '')}. "
             f"`benchmarks/cuda/models_bench.py`. {data.get('note', '')}", "",
             _table(("model", "variant", "tokens/s", "vs eager", "vs compile", "peak GiB", "first step s"),
                    ((row["model"], f"`{row['variant']}`", f"{row['tokens_per_s']:,}" if row.get("tokens_per_s")
                      else "failed: " + (row.get("error") or row.get("process_error") or "?")[:60],
                      row.get("speed_vs_eager", "-"), row.get("speed_vs_compile", "-"),
                      f"{row['peak_GiB']:.1f}" if row.get("peak_GiB") else "-",
                      f"{row['first_step_s']:.1f}" if row.get("first_step_s") else "-") for row in data["rows"])), ""]
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
             "measured side by side in one run on one machine, each in its own process; ratios are against the "
             "baseline of that run.", "", "## Headline", "",
             _table(("result", "device", "against", "speed", "peak memory", "commit", "file"),
                    ((r["what"], r["device"], r["against"], r["speed"], r["memory"], f"`{r['commit']}`",
                      f"`{r['file']}`") for r in headline_rows(results))), ""]
    if chart_dir is not None and results:
        parts += [f"![headline]({chart_dir}/{CHART.name})", ""]
    parts += ["## Against eager PyTorch", "", summary_table(results), ""]
    if "trainer-qwen3-0.6b-h100" in results:
        parts += _trainer_section(results["trainer-qwen3-0.6b-h100"], chart_dir)
    for stem in ("moe-h100", "gemma-h100"):
        if stem in results:
            parts += _models_section(stem, results[stem], chart_dir)
    if "decode-h100" in results:
        parts += _decode_section(results["decode-h100"], chart_dir)
    for stem, data in results.items():
        rows = _qwen3_rows(data)
        if stem.startswith("qwen3-") and rows:
            parts += [f"## Training loop, Qwen3-0.6B shape (`{stem}.json`)", "",
                      f"{data.get('config', '')}; {_device(data)}, {_date(data)}, commit `{_commit(data)}`.", "",
                      _table(("variant", "train tokens/s", "train peak GiB", "prefill ms"),
                             ((r["variant"], f"{r['train_tokens_per_s']:,.0f}", f"{r['train_peak_GiB']:.1f}",
                               f"{r['prefill_ms']:.1f}" if r.get("prefill_ms") is not None else "-")
                              for r in rows)), ""]
            if chart_dir is not None and len(rows) > 1:
                parts += [f"![{stem} throughput]({chart_dir}/{stem}-throughput.svg)",
                          f"![{stem} memory]({chart_dir}/{stem}-memory.svg)", ""]
    parts += ["## Every results file", "",
              _table(("file", "device", "date", "commit"),
                     ((f"`{stem}.json`", _device(data), _date(data), _commits(data))
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
