"""Tables and charts from ``benchmarks/results/*.json``: the README's table and chart, the benchmarks page.

How to run it: :mod:`tools.report`. Each results file is named ``<benchmark>-<device>.json`` and states the commit
that recorded it (``commit``, or ``environment.commit``). A file holding several runs keeps them under ``runs``, each
with its own environment: a list of named runs, or ``distributed_bench``'s runs by GPU count (``"1"``, ``"2"``)
beside their ``scaling``. Files the report has no table for are still listed in the inventory with their device,
date and commit.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from tools.report.data import BASELINES
from tools.report.data import DISTRIBUTED_HEADLINE
from tools.report.data import FSDP2_RECIPES
from tools.report.data import MODEL_NAMES
from tools.report.data import MODELS_HEADLINE
from tools.report.data import PAGE_ONLY
from tools.report.data import RESULTS
from tools.report.data import ROOT
from tools.report.data import VARIANT_NAMES
from tools.report.data import bare_model_name
from tools.report.data import commit_of
from tools.report.data import commits_of
from tools.report.data import date_of
from tools.report.data import device_of
from tools.report.data import env_of
from tools.report.data import fsdp2_recipe_runs
from tools.report.data import fsdp_setup
from tools.report.data import gpu_count
from tools.report.data import gpu_counts
from tools.report.data import load_results
from tools.report.data import long_device
from tools.report.data import markdown_table
from tools.report.data import median
from tools.report.data import model_name
from tools.report.data import per_gpu_suffix
from tools.report.data import row_where
from tools.report.data import short_device
from tools.report.data import thousands
from tools.report.data import trainer_numbers
from tools.report.sections import decode_ab_section
from tools.report.sections import decode_section
from tools.report.sections import distributed_section
from tools.report.sections import fsdp2_recipe_section
from tools.report.sections import models_section
from tools.report.sections import models_title
from tools.report.sections import trainer_section


__all__ = ["charts", "generated", "headline_chart", "headline_rows", "headline_table", "load_results", "page",
           "summary_table", "update_readme"]

README = ROOT / "README.md"
ASSETS = ROOT / "docs" / "assets"
CHART = ASSETS / "results.svg"
PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


# ---------------------------------------------------------------------------------------------------------------
# The README's headline table: one row per result, short cells, ratios against the baseline of the same run.


# trainer_bench results in the headline, per file-name prefix: (variant, what, against, chart label); each row
# compares the variant with the plain Trainer and with use_liger_kernel=True of the same file.
_AGAINST = "plain Trainer / `use_liger_kernel=True`"
TRAINER_ROWS = (
    ("trainer-fsdp2-", (("kernelize", "Trainer under FSDP2, Qwen3-0.6B shape: `KernelizeCallback`", _AGAINST,
                         "Trainer under FSDP2, Qwen3-0.6B: KernelizeCallback vs plain Trainer"),)),
    ("trainer-zero", (("kernelize_before", "Trainer under DeepSpeed ZeRO-{stage}, Qwen3-0.6B shape: kernelize, then "
                       "the Trainer", _AGAINST, "Trainer under ZeRO-{stage}, Qwen3-0.6B: kernelize, then the Trainer"),
                      ("kernelize", "Trainer under DeepSpeed ZeRO-{stage}, Qwen3-0.6B shape: `KernelizeCallback`",
                       _AGAINST, "Trainer under ZeRO-{stage}, Qwen3-0.6B: KernelizeCallback vs plain Trainer"))),
    ("trainer-lora", (("kernelize", "Trainer + PEFT LoRA on every decoder linear, Qwen3-0.6B shape: "
                       "`KernelizeCallback`", "plain PEFT / `use_liger_kernel=True`",
                       "Trainer + LoRA, Qwen3-0.6B: KernelizeCallback vs plain PEFT"),)),
    ("trainer-packing-", (("kernelize", "Trainer, packed rows (`DataCollatorWithFlattening`, 4 documents of 2,048 "
                           "tokens a row), Qwen3-0.6B shape: `KernelizeCallback`", "plain Trainer",
                           "Trainer, packed rows, Qwen3-0.6B: KernelizeCallback vs plain Trainer"),)),
    ("trainer-trl-packing-", (("kernelize", "TRL `SFTTrainer`, `packing` + `padding_free` (4 documents of 2,048 "
                               "tokens a row), Qwen3-0.6B shape: `KernelizeCallback`", "plain `SFTTrainer`",
                               "TRL SFTTrainer, packed, Qwen3-0.6B: KernelizeCallback vs plain"),)),
)


def headline_rows(results: dict[str, dict]) -> list[dict]:
    """Headline results as dicts: what, device, against, speed, memory, commit, file (and ``ratio`` for the chart).

    ``speed`` is the throughput ratio (tokens/s, or ms per token inverted), ``memory`` the peak-memory ratio;
    both against the named baseline measured in the same run. Benchmarks whose files are missing are skipped.
    """
    out: list[dict] = []

    def add(stem: str, what: str, against: str, ratio: float | None, speed: str, memory: str, commit: str, *,
            device: str | None = None, label: str | None = None) -> None:
        out.append({"what": what, "device": device or short_device(results[stem]), "against": against,
                    "ratio": ratio, "speed": speed, "memory": memory, "commit": commit, "file": f"{stem}.json",
                    "label": label})

    if "trainer-qwen3-0.6b-h100" in results:
        stem = "trainer-qwen3-0.6b-h100"
        data = results[stem]
        r = data["results"]
        tok, peak = trainer_numbers(data)
        c = r["kernelize"].get("commit") or commit_of(data)
        c_compile = r["kernelize_compile"].get("commit") or env_of(data).get("commit") or commit_of(data)
        add(stem, "Trainer, Qwen3-0.6B shape: `KernelizeCallback`", "`use_liger_kernel=True`",
            tok["kernelize"] / tok["liger"],
            f"**{tok['kernelize'] / tok['liger']:.2f}x** ({thousands(tok['kernelize'])} tok/s)",
            f"{peak['kernelize'] / peak['liger']:.2f}x ({peak['kernelize']:.1f} GiB)", c)
        add(stem, "Trainer + `torch_compile`: `KernelizeCallback`", "plain Trainer + `torch_compile`",
            tok["kernelize_compile"] / tok["plain_compile"],
            f"**{tok['kernelize_compile'] / tok['plain_compile']:.2f}x** "
            f"({thousands(tok['kernelize_compile'])} tok/s)",
            f"{peak['kernelize_compile'] / peak['plain_compile']:.2f}x ({peak['kernelize_compile']:.1f} GiB)",
            c_compile)
    for stem, data in results.items():
        rows = next((rows for prefix, rows in TRAINER_ROWS if stem.startswith(prefix)), None)
        if rows is None or "results" not in data:
            continue
        tok, peak = trainer_numbers(data)
        stage = re.search(r"ZeRO-(\d)", data.get("shape", ""))
        where = {"stage": stage.group(1) if stage else "?"}
        each = per_gpu_suffix(gpu_count(data))
        for variant, what, against, label in rows:
            if not {"plain", variant} <= tok.keys():
                continue
            # Against use_liger_kernel=True too where the file has it (the against text names both then).
            liger = f" / {tok[variant] / tok['liger']:.2f}x" if "liger" in tok else ""
            liger_peak = f" / {peak[variant] / peak['liger']:.2f}x" if "liger" in peak else ""
            add(stem, what.format(**where), against, tok[variant] / tok["plain"],
                f"**{tok[variant] / tok['plain']:.2f}x**{liger} ({thousands(tok[variant])} tok/s)",
                f"{peak[variant] / peak['plain']:.2f}x{liger_peak} ({peak[variant]:.1f} GiB{each})", commit_of(data),
                label=f"{label.format(**where)} ({short_device(data)})")
    for stem, data in results.items():
        if not stem.startswith("packing-"):
            continue
        # A file holds one run, or several ("runs"), each with its own environment: ratios only within a run.
        runs = data.get("runs") or [data]
        # Packed against unpacked measured inside one process supersedes the A/Bs of one process per side, whose
        # process-to-process spread was larger than the difference (they stay in the file and on its page).
        in_process = any(row.get("kind") == "interleave" for run in runs for row in run.get("rows", ()))
        for run in runs:
            _packing_rows(stem, run, add, in_process=in_process)
    for stem, data in results.items():
        if stem.startswith("recompute-product-"):
            _recompute_rows(stem, data, add)
        elif stem.startswith("llamafactory-") and data.get("summary"):
            _llamafactory_row(stem, data, add)
    for stem, data in results.items():
        if not (stem.startswith("fp8-accuracy") and data.get("summary")):
            continue
        depth = re.search(r"(\d+) layers", data.get("config", ""))
        layers = f"{depth.group(1)} layers" if depth else "4 layers"
        task = data.get("task") or {}
        steps = re.search(r"(\d+) steps", data.get("config", ""))
        finals = {row["variant"]: row["final_loss"] for row in data.get("rows", ()) if "final_loss" in row}
        bf16_runs = sorted(loss for variant, loss in finals.items() if variant.partition("@")[0] == "bf16")
        spread = (f"; bf16 runs from {len(bf16_runs)} initial weights end up to "
                  f"{bf16_runs[-1] / bf16_runs[0] - 1:.1%} apart" if len(bf16_runs) > 1 else "")
        for recipe, pairs in _fp8_pairs(data["summary"]).items():
            learned = ""
            if task.get("log_vocab_nats") and task.get("entropy_rate_nats"):
                # How much of the learnable gap bf16 closed: a run that barely learns the task proves little.
                gap = task["log_vocab_nats"] - task["entropy_rate_nats"]
                closed = (task["log_vocab_nats"] - pairs[0]["bf16_final_loss"]) / gap
                learned = f"; bf16 learned {closed:.0%} of the task"
            speed = median([pair["tokens_per_s_ratio"] for pair in pairs])
            if len(pairs) == 1:
                loss = f"final loss {pairs[0]['final_loss_rel_diff']:+.2%}"
            else:
                # Several initial weights: the mean final loss of the FP8 runs against bf16's from the same weights.
                mean = sum(p["final_loss"] for p in pairs) / sum(p["bf16_final_loss"] for p in pairs) - 1
                each = ", ".join(f"{p['final_loss_rel_diff']:+.1%}" for p in pairs)
                loss = f"final loss {mean:+.2%}, mean of {len(pairs)} initial weights ({each})"
            add(stem, f"FP8 training ({recipe}), Llama-3.1-8B shape ({layers}), {steps.group(1) if steps else '?'} "
                "steps of a learnable task: kernelize + compile + FP8",
                "kernelize + compile, bf16" + (", same initial weights" if len(pairs) > 1 else ""), speed,
                f"{speed:.2f}x; {loss}{learned}{spread}", "-",
                commit_of(data), label=f"FP8 {recipe}, Llama-3.1-8B ({layers}) ({short_device(data)}) vs bf16")
    for stem, data in results.items():
        if not stem.startswith("experts-fp8"):
            continue
        # experts_fp8_bench: FP8 grouped products against bf16 ones at one MoE layer (why no FP8 experts kernel).
        for row in data["rows"]:
            ms = row["ms"]
            key = "_compiled" if "fp8_products_compiled" in ms else ""
            ratio = ms[f"bf16_products{key}"] / ms[f"fp8_products{key}"]
            add(stem, f"MoE experts' products in FP8 (torchao 0.17's rowwise grouped products), Qwen3-30B-A3B shape, "
                f"one layer forward + backward, {row['tokens']:,} tokens{', torch.compile' if key else ''}",
                "the same products in bf16", ratio,
                f"{ratio:.2f}x ({ms[f'fp8_products{key}']:.1f} against {ms[f'bf16_products{key}']:.1f} ms)", "-",
                commit_of(data), label=f"FP8 experts' products, Qwen3-30B-A3B, {row['tokens']} tokens "
                                       f"({short_device(data)}) vs bf16")
    for stem, data in results.items():
        if not stem.startswith("distributed-") or stem in PAGE_ONLY:
            continue
        model = model_name(data)
        setup = fsdp_setup(data)
        model += f" ({setup})" if setup else ""
        counts = gpu_counts(data)
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
                commit_of(data), device=" and ".join(f"{n}x" for n in counts) + f" {short_device(data, 1)}",
                label=f"FSDP2 training loop, {_chart_name(model)}: kernelize, then fully_shard "
                      f"({counts[-1]}x {short_device(data, 1)}) vs eager")
            continue
        variants = data.get("variants", {})
        for variant, label, against in DISTRIBUTED_HEADLINE:
            ratio = data.get("ratios_vs_eager", {}).get(variant)
            if ratio is None or variant not in variants:
                continue
            bold = "**" if variant == "kernelize_before" else ""
            liger = data.get("ratios_vs_eager", {}).get(f"{variant}_vs_liger")
            versus = "" if liger is None else f" / {liger['tokens_per_s']:.2f}x"
            add(stem, f"FSDP2 training, {model}: {label}", against + (" / Liger-Kernel" if liger else ""),
                ratio["tokens_per_s"],
                f"{bold}{ratio['tokens_per_s']:.2f}x{bold}{versus} "
                f"({thousands(variants[variant]['tokens_per_s'])} tok/s)",
                f"{ratio['peak']:.2f}x" + ("" if liger is None else f" / {liger['peak']:.2f}x")
                + f" ({variants[variant]['peak_GiB']:.1f} GiB/GPU)", commit_of(data))
    # The one-GPU FSDP2 recipe with per-layer compile: its median over every run (the host-bound step varies
    # from run to run more than any one run's rounds show). The row links one of the files; the benchmarks page's
    # recipe section lists every run.
    recipe = FSDP2_RECIPES[1][1]
    runs = [run for run in fsdp2_recipe_runs(results) if recipe in run["ratios"]]
    if runs:
        speeds = [run["ratios"][recipe] for run in runs]
        peaks = [run["peaks"][recipe] for run in runs if recipe in run["peaks"]]
        add(runs[-1]["file"], "FSDP2 training loop, Qwen3-0.6B shape (one unit per decoder layer): kernelize + "
            "compile per layer, elementwise kinds left to Inductor, gathered layers kept to backward, two prefetched, "
            "AdamW on local shards", "eager", median(speeds),
            f"**{median(speeds):.2f}x** (median of {len(speeds)} runs in "
            f"{len({run['file'] for run in runs})} files, {min(speeds):.2f}x-{max(speeds):.2f}x; see the "
            "benchmarks page)",
            f"{median(peaks):.2f}x", ", ".join(dict.fromkeys(run["commit"] for run in runs)),
            label="FSDP2 loop, Qwen3-0.6B, per-layer compile recipe (H200) vs eager, median of runs")
    for stem, (label, pairs) in MODELS_HEADLINE.items():
        if stem not in results:
            continue
        data = results[stem]
        for model in dict.fromkeys(row["model"] for row in data["rows"]):
            by = {row["variant"]: row for row in data["rows"] if row["model"] == model and row.get("tokens_per_s")}
            for variant, base in pairs:
                if variant in by and base in by:
                    ratio = by[variant]["tokens_per_s"] / by[base]["tokens_per_s"]
                    name = VARIANT_NAMES.get(variant, variant.replace("_", " + "))
                    add(stem, f"{label}, {MODEL_NAMES.get(model, model)}: {name}",
                        BASELINES[base], ratio,
                        f"**{ratio:.2f}x** ({thousands(by[variant]['tokens_per_s'])} tok/s)",
                        f"{by[variant]['peak_GiB'] / by[base]['peak_GiB']:.2f}x ({by[variant]['peak_GiB']:.1f} GiB)",
                        commit_of(data))
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
                f"{bold}{ratio:.2f}x{bold} ({thousands(row['train_tokens_per_s'])} tok/s)",
                f"{row['train_peak_GiB'] / compile_['train_peak_GiB']:.2f}x ({row['train_peak_GiB']:.1f} GiB)",
                commit_of(data))
    if "decode-h100" in results:
        data = results["decode-h100"]
        # Compile against kernelize + compile: the in-process alternating run where there is one (both sides share
        # the process's host conditions), else the per-process cells.
        ab_stem = "decode-compile-ab-h100"
        ab = results.get(ab_stem, {}).get("summary", {})
        for model in dict.fromkeys(row["model"] for row in data["rows"]):
            for cache, variant, base, label in (("dynamic", "kernelize", "eager", "kernelize"),
                                                ("static", "kernelize_compile", "compile", "kernelize + compile")):
                name = f"Decoding, {MODEL_NAMES.get(model, model)}, {cache} cache: {label}"
                against = "eager" if base == "eager" else "`torch.compile`"
                cells = [ab.get(f"{model} batch {batch}") for batch in (1, 8)]
                if variant == "kernelize_compile" and all(cells):
                    stem, name, source = ab_stem, f"{name} (one process, alternating)", results[ab_stem]
                    ratios = [cell["median"] for cell in cells]
                else:
                    stem, source = "decode-h100", data
                    ratios = [_decode_ms(data, model, cache, batch, base)
                              / _decode_ms(data, model, cache, batch, variant) for batch in (1, 8)]
                add(stem, name, against, ratios[0], f"{ratios[0]:.2f}x (batch 1), {ratios[1]:.2f}x (batch 8)", "-",
                    commit_of(source))
    for stem in ("portable-cpu",):
        if stem in results:
            data = results[stem]
            summary = data["variants"]["kernelized"]["summary"]
            speed = 1 / summary["time_ratio_vs_eager"]
            add(stem, "Portable kernels only (no vendor plugin), training step", "eager", speed, f"{speed:.2f}x",
                f"**{summary['peak_ratio_vs_eager']:.2f}x**", commit_of(data))
    return out


def _decode_ms(data: dict, model: str, cache: str, batch: int, variant: str) -> float:
    return float(row_where(data, model=model, cache=cache, batch=batch, variant=variant)["ms_per_token"])


def headline_table(results: dict[str, dict]) -> str:
    """The README's results table (Markdown)."""
    return markdown_table(("result", "device", "against", "speed", "peak memory", "commit"),
                          ((row["what"], row["device"], row["against"], row["speed"], row["memory"],
                            f"[`{row['commit']}`](benchmarks/results/{row['file']})")
                           for row in headline_rows(results)))


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
            tok, peak = trainer_numbers(data)
            for variant in ("kernelize", "kernelize_compile"):
                if variant in tok and "plain" in tok:
                    add(f"Trainer, Qwen3-0.6B shape, `{variant}`", long_device(data), tok[variant] / tok["plain"],
                        peak[variant] / peak["plain"], stem)
        elif stem.startswith("distributed-"):
            model = model_name(data)
            runs = [(int(n), data["runs"][n]) for n in gpu_counts(data)] or [(gpu_count(data), data)]
            for gpus, run in runs:
                v = run.get("variants", {})
                if "eager" not in v:
                    continue
                for variant in ("kernelize_before", "kernelize_after", "kernelize_compile"):
                    if variant in v:
                        add(f"FSDP2 training, {model}, `{variant}`", long_device(data, gpus),
                            v[variant]["tokens_per_s"] / v["eager"]["tokens_per_s"],
                            v[variant]["peak_GiB"] / v["eager"]["peak_GiB"], stem)
        elif stem in MODELS_HEADLINE:
            for model in dict.fromkeys(row["model"] for row in data["rows"]):
                by = {r["variant"]: r for r in data["rows"] if r["model"] == model and r.get("tokens_per_s")}
                for variant in ("kernelize", "kernelize_compile"):
                    if variant in by and "eager" in by:
                        add(f"{MODEL_NAMES.get(model, model)} training, `{variant}`", long_device(data),
                            by[variant]["tokens_per_s"] / by["eager"]["tokens_per_s"],
                            by[variant]["peak_GiB"] / by["eager"]["peak_GiB"], stem)
        elif stem.startswith("qwen3-") and any(r["variant"] == "eager" for r in _qwen3_rows(data)):
            by = {r["variant"]: r for r in _qwen3_rows(data)}
            eager = by["eager"]
            for variant in ("kernelize", "kernelize_compile"):
                if variant in by:
                    r = by[variant]
                    add(f"Qwen3-0.6B shape training loop, `{variant}`", long_device(data),
                        r["train_tokens_per_s"] / eager["train_tokens_per_s"],
                        r["train_peak_GiB"] / eager["train_peak_GiB"], stem)
        elif stem.startswith("portable-") and "variants" in data:
            v = data["variants"]
            if "eager" in v and "kernelized" in v:
                add("portable kernels only, training step", long_device(data),
                    median(v["eager"]["step_seconds"]) / median(v["kernelized"]["step_seconds"]),
                    v["kernelized"]["peak_bytes"] / v["eager"]["peak_bytes"], stem)
    return markdown_table(("what", "device", "throughput vs eager", "peak memory vs eager", "results file"), rows)


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
            tok, _ = trainer_numbers(data)
            out[f"{stem}.svg"] = _bar_chart(
                f"Trainer, Qwen3-0.6B shape, {short_device(data)}: steady tokens/s",
                [(name, value / 1000) for name, value in tok.items()], "k")
        elif stem.startswith("distributed-") and (data.get("runs") or data.get("variants")):
            counts = gpu_counts(data)
            runs = [(int(n), data["runs"][n]) for n in counts] or [(gpu_count(data), data)]
            values = [(f"{gpus} GPU{'s' if gpus > 1 else ''}: {name}", row["tokens_per_s"] / gpus / 1000)
                      for gpus, run in runs for name, row in run.get("variants", {}).items()
                      if row.get("tokens_per_s")]
            out[f"{stem}.svg"] = _bar_chart(f"FSDP2, {short_device(data, 1)}: tokens/s per GPU", values, "k",
                                            label_width=260)
    # Every file of the headline, and every one with a section of its own on the page (which links its chart).
    for stem in dict.fromkeys([*(stem for stem in MODELS_HEADLINE if stem in results), *_models_pages(results)]):
        rows = [(f"{row['model']} {row['variant']}", row["tokens_per_s"] / 1000)
                for row in results[stem]["rows"] if row.get("tokens_per_s")]
        out[f"{stem}.svg"] = _bar_chart(
            f"{models_title(results[stem])[:60]}, {short_device(results[stem])}: tokens/s", rows, "k",
            label_width=300)
    if "decode-h100" in results:
        rows = [(f"{row['model']} {row['cache']} b{row['batch']} {row['variant']}", row["ms_per_token"])
                for row in results["decode-h100"]["rows"]]
        out["decode-h100.svg"] = _bar_chart("Decoding, H100: ms per token (shorter is faster)", rows, " ms",
                                            label_width=330, digits=2)
    return out


# How models_bench and distributed_bench compute a row's floor (benchmarks/cuda/floor.py holds the details).
FLOOR_METHOD = (
    "`models_bench.py` and `distributed_bench.py` give each dense row `floor_ms`, the step's time if every part ran "
    "at the speed this machine reaches for that part alone, and `floor_fraction`, the floor over the measured step. "
    "The parts, timed in the same run on the same GPU: every linear layer's forward, input-gradient and "
    "weight-gradient GEMM (decoder projections and `lm_head`) with cuBLAS at its exact shape (`torch.mm` in bf16, "
    "`torch._scaled_mm` for FP8 projections); attention as transformers' sdpa path calls "
    "`scaled_dot_product_attention`, forward and backward, on the backend PyTorch picks for it (causal with "
    "grouped KV heads; Gemma-3's sliding-window layers with their mask); the memory-bound work (RMSNorms, residual "
    "adds, rotary embeddings, the gated activation, the embedding, the loss, FP8 casts) at the fewest bytes each "
    "must move, and AdamW's seven parameter-sized tensors, both at the bandwidth of a 1 GiB device copy; under "
    "FSDP2 the exposed part of the measured all-gathers and reduce-scatters of each unit. Activation "
    "checkpointing counts the decoder layers' forward twice. With `--profile` a row also says where the rest goes: "
    "`gpu_idle_ms` (the step's time with no kernel running, the host's share) and `kernels_above_floor_ms`. MoE "
    "shapes are not modelled (the experts' grouped GEMMs depend on the routing) and their rows say so.")


def page(results: dict[str, dict], *, chart_dir: str | None = None) -> str:
    """The benchmarks page: headline, per-benchmark tables, charts, and an inventory of every results file."""
    parts = ["# Benchmarks", "",
             "<!-- Generated by `python -m tools.report --write`; edit the results files or tools/report/. -->", "",
             "Generated by `python -m tools.report` from `benchmarks/results/*.json`. Variants of a benchmark are "
             "measured side by side in one run on one machine, each in its own process "
             "(`distributed_bench.py`: one after the other in one `torchrun` job); ratios are against the baseline "
             "of that run.", "", "## Headline", "",
             markdown_table(("result", "device", "against", "speed", "peak memory", "commit", "file"),
                            ((r["what"], r["device"], r["against"], r["speed"], r["memory"], f"`{r['commit']}`",
                              f"`{r['file']}`") for r in headline_rows(results))), ""]
    if chart_dir is not None and results:
        parts += [f"![headline]({chart_dir}/{CHART.name})", ""]
    parts += ["## Against eager PyTorch", "", summary_table(results), ""]
    for stem, data in results.items():
        if stem.startswith("trainer-") and "results" in data:
            parts += trainer_section(stem, data, chart_dir)
    for stem, data in results.items():
        if stem.startswith("distributed-") and (data.get("runs") or data.get("variants")):
            parts += distributed_section(stem, data, chart_dir)
    parts += fsdp2_recipe_section(fsdp2_recipe_runs(results))
    for stem in _models_pages(results):
        parts += models_section(stem, results[stem], chart_dir)
    if "decode-h100" in results:
        parts += decode_section(results["decode-h100"], chart_dir)
    bindings = {row["model"]: row["binding"] for row in results.get("decode-h100", {}).get("rows", ())
                if row.get("variant") == "kernelize_compile" and row.get("binding")}
    for stem, data in results.items():
        if stem.startswith("decode-compile-ab-") and "summary" in data:
            parts += decode_ab_section(stem, data, bindings)
    for stem, data in results.items():
        rows = _qwen3_rows(data)
        if stem.startswith("qwen3-") and rows:
            parts += [f"## Training loop, Qwen3-0.6B shape, {short_device(data)} (`{stem}.json`)", "",
                      f"{data.get('config', '')}; {device_of(data)}, {date_of(data)}, commit `{commit_of(data)}`. "
                      "`benchmarks/cuda/qwen3_bench.py`.", "",
                      markdown_table(("variant", "train tokens/s", "train peak GiB", "prefill ms"),
                                     ((r["variant"], f"{r['train_tokens_per_s']:,.0f}", f"{r['train_peak_GiB']:.1f}",
                                       f"{r['prefill_ms']:.1f}" if r.get("prefill_ms") is not None else "-")
                                      for r in rows)), ""]
            if chart_dir is not None and len(rows) > 1:
                parts += [f"![{stem} throughput]({chart_dir}/{stem}-throughput.svg)",
                          f"![{stem} memory]({chart_dir}/{stem}-memory.svg)", ""]
    parts += ["## Floor accounting", "", FLOOR_METHOD, ""]
    parts += ["## Every results file", "",
              markdown_table(("file", "device", "date", "commit"),
                             ((f"`{stem}.json`", long_device(data), date_of(data), commits_of(data))
                              for stem, data in results.items())), ""]
    return "\n".join(parts)


def _models_pages(results: dict[str, dict]) -> list[str]:
    """The models_bench files the page gives a section of their own, each linking its chart."""
    return [stem for stem, data in results.items()
            if stem in ("moe-h100", "gemma-h100") or (stem.startswith("models-") and data.get("rows"))]


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
                print(f"{path.relative_to(ROOT)} is out of date: run python -m tools.report --write",
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


def _packing_rows(stem: str, run: dict, add: Callable[..., None], *, in_process: bool = False) -> None:
    for row in run.get("rows", ()):
        if row.get("kind") != "interleave" or "packed_vs_unpacked_median" not in row:
            continue
        # packing_bench --interleave: both layouts in one process, alternating blocks of steps.
        where = ("copied from the host, as the Trainer's data loader sends it" if row["host_batches"]
                 else "kept on the GPU")
        rounds = row["packed_vs_unpacked_each_round"]
        peak = row["peak_GiB"]
        add(stem, f"Packed rows (4 documents of 2,048 tokens in one row), {bare_model_name(row['model'])}: "
            f"kernelize, each step's batch {where}", "kernelize, the same documents unpacked, same process",
            row["packed_vs_unpacked_median"],
            f"**{row['packed_vs_unpacked_median']:.2f}x**, median of {len(rounds)} alternating rounds "
            f"({min(rounds):.2f}-{max(rounds):.2f}; {thousands(row['tokens_per_s_median']['packed'])} tok/s)",
            f"{peak['packed'] / peak['unpacked']:.2f}x ({peak['packed']:.1f} GiB)", commit_of(run),
            label=f"Packed / unpacked in one process, {row['model']}, batches "
                  f"{'from the host' if row['host_batches'] else 'on the GPU'} ({short_device(run)})")
    ab = (run.get("summary") or {}).get("qwen3-0.6b", {}).get("packed/unpacked")
    if ab and not in_process:
        # configs_ab: packed and unpacked sides alternating in one A/B, the median of the per-round ratios.
        host = "from pinned host memory" in run.get("setup", "")
        where = ("copied from the host, as the Trainer's data loader sends it" if host
                 else "kept on the GPU")
        if "busy" in run.get("name", ""):
            where += " (the host's other GPU busy)"
        packed = run["summary"]["qwen3-0.6b"]["packed"]
        add(stem, f"Packed rows (4 documents of 2,048 tokens in one row), Qwen3-0.6B shape: kernelize, each step's "
            f"batch {where}", "kernelize, the same documents unpacked", ab["median_of_round_ratios"],
            f"{ab['median_of_round_ratios']:.2f}x, median of {len(ab['round_ratios'])} alternating rounds "
            f"({thousands(packed['median'])} tok/s)", "-", commit_of(run),
            label=f"Packed / unpacked, batches {'from the host' if host else 'on the GPU'} ({short_device(run)})")
        return
    rows = {(r.get("layout"), r.get("variant")): r for r in run.get("rows", ()) if r.get("tokens_per_s")}
    packed, mixed = rows.get(("packed", "kernelize")), rows.get(("mixed", "kernelize"))
    compiled = rows.get(("packed", "kernelize_compile"))
    if packed and packed.get("speed_vs_eager") and packed.get("speed_vs_unpacked"):
        # Against unpacked rows the rows of the alternating A/Bs (packing-ab-*.json) say it with today's kernels.
        add(stem, "Packed rows (4 documents of 2,048 tokens in one row, per-document attention), Qwen3-0.6B "
            "shape: kernelize", "eager, same packed rows", packed["speed_vs_eager"],
            f"**{packed['speed_vs_eager']:.2f}x** ({thousands(packed['tokens_per_s'])} tok/s)",
            f"{packed['peak_vs_eager']:.2f}x ({packed['peak_GiB']:.1f} GiB; {packed['peak_vs_unpacked']:.2f}x "
            "unpacked)", commit_of(run), label=f"Packed rows, Qwen3-0.6B ({short_device(run)}) vs eager packed")
    if compiled and compiled.get("speed_vs_compile") and compiled.get("speed_vs_unpacked"):
        add(stem, "Packed rows as above: kernelize + `torch.compile`",
            "`torch.compile`, same packed rows / kernelize + compile, unpacked", compiled["speed_vs_compile"],
            f"**{compiled['speed_vs_compile']:.2f}x** / {compiled['speed_vs_unpacked']:.2f}x "
            f"({thousands(compiled['tokens_per_s'])} tok/s)",
            f"{compiled['peak_vs_compile']:.2f}x / {compiled['peak_vs_unpacked']:.2f}x "
            f"({compiled['peak_GiB']:.1f} GiB)",
            commit_of(run), label=f"Packed rows, Qwen3-0.6B ({short_device(run)}) vs compile packed")
    if mixed and mixed.get("speed_vs_padded"):
        add(stem, "Documents of 64-4,096 tokens packed in one row, Qwen3-0.6B shape: kernelize",
            "kernelize, the same documents padded", mixed["speed_vs_padded"],
            f"**{mixed['speed_vs_padded']:.2f}x** ({thousands(mixed['tokens_per_s'])} real tok/s)",
            f"{mixed['peak_vs_padded']:.2f}x ({mixed['peak_GiB']:.1f} GiB)", commit_of(run),
            label=f"Mixed-length packing, Qwen3-0.6B ({short_device(run)}) vs padded")


def _fp8_pairs(summary: dict) -> dict[str, list[dict]]:
    """fp8_accuracy's summary entries by FP8 recipe (``fp8_rowwise@init1`` under ``rowwise``), each against bf16
    from the same initial weights; bf16's own runs from other weights are left out."""
    pairs: dict[str, list[dict]] = {}
    for variant, entry in summary.items():
        recipe = variant.partition("@")[0]
        if recipe.startswith("fp8_"):
            pairs.setdefault(recipe.removeprefix("fp8_"), []).append(entry)
    return pairs


def _recompute_rows(stem: str, data: dict, add: Callable[..., None]) -> None:
    # configs_ab runs of recompute_product on (the default) against off, the first run's shapes first: a shape is
    # shown from the first run that has it.
    shown = set()
    for run in data["runs"]:
        for shape, summary in run.get("summary", {}).items():
            if shape in shown:
                continue
            shown.add(shape)
            ab = summary.get("recompute/keep")
            peaks = {side: [r["train_peak_GiB"] for r in run["rows"] if r["shape"] == shape and r["side"] == side]
                     for side in ("recompute", "keep")}
            if not ab or not all(peaks.values()):
                continue
            peak = max(peaks["recompute"]) / max(peaks["keep"])
            add(stem, f"Gated MLP's `act(gate) * up` recomputed in backward (the default), "
                f"{_ab_shape(shape, run)}: kernelize", "kernelize keeping it (`recompute_product = false`)",
                ab["median_of_round_ratios"],
                f"{ab['median_of_round_ratios']:.2f}x, median of {len(ab['round_ratios'])} alternating rounds "
                f"({min(ab['round_ratios']):.3f}-{max(ab['round_ratios']):.3f})",
                f"**{peak:.2f}x** ({max(peaks['recompute']):.1f} GiB)", commit_of(run),
                label=f"Recomputed gated-MLP product, {shape} ({short_device(run)})")


def _ab_shape(shape: str, run: dict) -> str:
    """A configs_ab shape's name with the depth it was built at (its ``shapes`` entry)."""
    layers = (run.get("shapes") or {}).get(shape, {}).get("layers")
    name = bare_model_name(shape)
    return f"{name} ({layers} layers)" if layers and shape != "qwen3-0.6b" else name


def _llamafactory_row(stem: str, data: dict, add: Callable[..., None]) -> None:
    summary = data["summary"]
    kernels = data["results"]["kernels"]
    add(stem, f"LLaMA-Factory v1 SFT, packed rows (`{kernels['batching_strategy']}`), its defaults (float32, "
        "activation checkpointing), Qwen3-0.6B shape: `KernelPlugin`", "plain LLaMA-Factory",
        summary["kernels_vs_plain_tokens"],
        f"{summary['kernels_vs_plain_tokens']:.2f}x ({thousands(kernels['steady_tokens_per_second'])} tok/s); losses "
        f"within {summary['max_rel_loss_gap']:.0e} relative",
        f"{summary['kernels_vs_plain_memory']:.2f}x ({kernels['peak_memory_gib']:.1f} GiB)", commit_of(data),
        label=f"LLaMA-Factory v1 packed SFT ({short_device(data)})")
