"""The per-benchmark sections of the benchmarks page (Trainer, distributed, models, decoding), for
:mod:`tools.report.generate`."""

from __future__ import annotations

import re

from tools.report.data import FSDP2_RECIPE_AA
from tools.report.data import FSDP2_RECIPES
from tools.report.data import MODEL_NAMES
from tools.report.data import commit_of
from tools.report.data import device_of
from tools.report.data import fsdp_setup
from tools.report.data import gpu_count
from tools.report.data import gpu_counts
from tools.report.data import long_device
from tools.report.data import markdown_table
from tools.report.data import median
from tools.report.data import model_name
from tools.report.data import short_device


def trainer_section(stem: str, data: dict, chart_dir: str | None) -> list[str]:
    gpus = gpu_count(data)
    rows = []
    for name, v in data["results"].items():
        if "error" in v:
            rows.append((f"`{name}`", "failed", "-", "-", v["error"].strip().splitlines()[-1][:80]))
            continue
        rows.append((f"`{name}`", f"{v['steady_tokens_per_second']:,.0f}", f"{v['train_tokens_per_second']:,.0f}",
                     f"{v['peak_memory_gib']:.2f}", "-"))
    summary = {key: value for key, value in data.get("summary", {}).items() if value is not None}
    where = f"one `torchrun` of {gpus} processes per variant" if gpus > 1 else "one process per variant"
    shape = data.get("shape", "Qwen3-0.6B").split(",")[0]
    parts = [f"## Trainer, {shape}, {short_device(data)} (`{stem}.json`)", "",
             f"{data.get('shape', '')}; {data.get('steps')} steps, {data.get('warmup_steps')} warm-up; "
             f"{long_device(data)}, commit `{commit_of(data)}`. `benchmarks/cuda/trainer_bench.py`, {where}. "
             "Steady tokens/s leaves out the warm-up steps (and compilation); the Trainer's own figure "
             "includes them." + (" Tokens/s count every GPU; peak memory is the largest of the GPUs'."
                                 if gpus > 1 else ""),
             "", markdown_table(("variant", "steady tokens/s", "Trainer tokens/s",
                                 "peak GiB" + (" per GPU" if gpus > 1 else ""), "error"), rows), ""]
    if summary:
        parts += [markdown_table(("ratio", "value"),
                                 ((f"`{key}`", f"{value:.3g}") for key, value in summary.items())), ""]
    if chart_dir is not None:
        parts += [f"![{stem}]({chart_dir}/{stem}.svg)", ""]
    return parts


def fsdp2_recipe_section(runs: list[dict]) -> list[str]:
    """Every one-GPU run of the FSDP2 recipes (:func:`tools.report.data.fsdp2_recipe_runs`), and their medians."""
    if not runs:
        return []

    def ratio(run: dict, name: str) -> float | None:
        return run["ratios"].get(name)

    def pair(run: dict, first: str, second: str) -> float | None:
        a, b = ratio(run, first), ratio(run, second)
        return None if a is None or b is None else a / b

    columns = [(f"{label}: before", lambda r, n=before: ratio(r, n)) for label, before, _ in FSDP2_RECIPES]
    columns += [(f"{label}: after", lambda r, n=after: ratio(r, n)) for label, _, after in FSDP2_RECIPES]
    columns += [(f"{label}: before / after", lambda r, b=before, a=after: pair(r, b, a))
                for label, before, after in FSDP2_RECIPES]
    columns += [(f"{label}: A/A", lambda r, a=first, b=second: pair(r, a, b))
                for label, first, second in FSDP2_RECIPE_AA]
    values = [[get(run) for _, get in columns] for run in runs]
    table = [(f"`{run['file']}.json`" + (f" ({run['process']})" if run["process"] else ""), f"`{run['commit']}`",
              str(run["rounds"]), f"{run['eager']:,.0f}", *(f"{v:.2f}" if v is not None else "-" for v in row))
             for run, row in zip(runs, values, strict=True)]
    medians = []
    for index in range(len(columns)):
        present = [row[index] for row in values if row[index] is not None]
        medians.append(f"**{median(present):.2f}** ({len(present)})" if present else "-")
    table.append(("median over runs (how many)", "", "", "", *medians))
    # Each recipe's before-fully_shard ratios, by name (not by the columns' order).
    eager_mode, compiled = ([run["ratios"][before] for run in runs if before in run["ratios"]]
                            for _, before, _ in FSDP2_RECIPES)
    return ["## FSDP2 on one GPU: the host-bound recipes, every run", "",
            "The Qwen3-0.6B shape under FSDP2 on one H200, one unit per decoder layer, foreach AdamW, 4 x 2048 "
            "tokens: every `distributed_bench.py` run of the integrations page's recipes (gathered layers kept to "
            "backward, two prefetched, AdamW on the local shards; in eager mode, and with each decoder layer compiled "
            "and the elementwise kinds left to Inductor), before and after `fully_shard`. A ratio is the variant's "
            "median round over eager's in the same run; `A/A` is a recipe over itself under a second name (the same "
            "code): how far two identical variants' medians fall apart on the same host.", "",
            markdown_table(("run", "commit", "rounds", "eager tokens/s",
                            *(name if "/" in name else f"vs eager, {name}" for name, _ in columns)), table), "",
            f"The eager-mode recipe reached 1.6x eager in {sum(v >= 1.6 for v in eager_mode)} of {len(eager_mode)} "
            f"runs, the per-layer compile recipe in {sum(v >= 1.6 for v in compiled)} of {len(compiled)}. Where and "
            "how each file's runs were made:", "",
            *(f"- `{stem}.json`: {what}" for stem, what in dict.fromkeys((run["file"], run["what"]) for run in runs)
              if what),
            ""]


def _loss_diff(data: dict, variant: str) -> str:
    ratio = data.get("ratios_vs_eager", {}).get(variant)
    if not ratio or ratio.get("max_rel_loss_diff") is None:
        return "-"
    return f"{ratio['max_rel_loss_diff']:.1e} ({ratio['vs']})"


def distributed_section(stem: str, data: dict, chart_dir: str | None) -> list[str]:
    model = model_name(data)
    setup = fsdp_setup(data)
    counts = gpu_counts(data)
    runs = [(int(n), data["runs"][n]) for n in counts] or [(gpu_count(data), data)]
    plural = "s" if len(runs) > 1 or str(runs[0][0]) != "1" else ""
    where = " and ".join(str(gpus) for gpus, _ in runs) + f" {short_device(data, 1)}{plural}"
    parts = [f"## FSDP2 training, {model}{', ' + setup if setup else ''}, {where} (`{stem}.json`)", "",
             *([f"{str(data['what'])[0].upper()}{str(data['what'])[1:]}.", ""] if data.get("what") else []),
             f"{data.get('config', '')}; {data.get('steps_timed')} timed steps after {data.get('steps_warmup')} "
             f"warm-up; {device_of(data)}, commit `{commit_of(data)}`. `benchmarks/cuda/distributed_bench.py`, one "
             "`torchrun` job per GPU count running the variants one after the other from the same seeds and data. "
             "Tokens/s count every GPU; peak memory is per GPU; the loss "
             "column is the largest relative difference from the baseline's loss (mean over ranks) at any step.", ""]
    table = []
    for gpus, run in runs:
        v = run.get("variants", {})
        for name, row in v.items():
            if row.get("tokens_per_s") is None:  # the variant failed: its error in place of the numbers
                table.append((gpus, f"`{name}`", f"failed: {str(row.get('error', '?')).splitlines()[0][:90]}",
                              *["-"] * 6))
                continue
            vs = {base: f"{row['tokens_per_s'] / v[base]['tokens_per_s']:.2f}x"
                  if v.get(base, {}).get("tokens_per_s") else "-" for base in ("eager", "compile")}
            table.append((gpus, f"`{name}`", f"{row['tokens_per_s']:,.0f}", f"{row['tokens_per_s'] / gpus:,.0f}",
                          vs["eager"], vs["compile"], f"{row['peak_GiB']:.1f}",
                          f"{row['first_step_s']:.1f}" if row.get("first_step_s") is not None else "-",
                          _loss_diff(run, name)))
    header = ["GPUs", "variant", "tokens/s", "per GPU", "vs eager", "vs compile", "peak GiB per GPU",
              "first step s", "loss diff (vs)"]
    if not any(row[5] != "-" for row in table):  # no compile variant: drop its column
        header.pop(5)
        table = [row[:5] + row[6:] for row in table]
    parts += [markdown_table(header, table), ""]
    graphs = [(name, row["cudagraphs"]) for _, run in runs for name, row in run.get("variants", {}).items()
              if row.get("cudagraphs")]
    if graphs:
        parts += ["Inductor's CUDA graph trees in the `+cudagraphs` rows (the process's counts up to that row: graphs "
                  "recorded, and recordings caused by inputs at new addresses):", "",
                  markdown_table(["variant", "graphs recorded", "recorded for new input addresses", "skips"],
                                 ((f"`{name}`", str(g.get("graphs_recorded", "-")),
                                   str(g.get("cudagraph_recorded_non_static_inputs", "-")),
                                   str(g.get("cudagraph_skips", 0))) for name, g in graphs)), ""]
    parts += _localstep_and_trace(runs)
    parts += _step_accounting(data.get("step_accounting"))
    scaling = data.get("scaling") or {}
    if scaling and len(counts) > 1:
        parts += [f"Tokens/s per GPU, and their ratio to the {counts[0]}-GPU figure (scaling efficiency):", "",
                  markdown_table(["variant", *(f"{n} GPU{'s' if n != '1' else ''}" for n in counts), "efficiency"],
                                 ((f"`{name}`", *(f"{s['tokens_per_s_per_gpu'][n]:,}" for n in counts),
                                   ", ".join(f"{s['efficiency'][n]:.2f} ({n} GPUs)" for n in counts[1:]))
                                  for name, s in scaling.items())), ""]
        first, last = data["runs"][counts[0]], data["runs"][counts[-1]]
        if {"eager", "kernelize_before"} <= scaling.keys() and "kernelize_before" in last.get("ratios_vs_eager", {}):
            k_eff = scaling["kernelize_before"]["efficiency"][counts[-1]]
            e_eff = scaling["eager"]["efficiency"][counts[-1]]
            parts += [f"Kernelized before `fully_shard`, the model runs "
                      f"{first['ratios_vs_eager']['kernelize_before']['tokens_per_s']:.2f}x eager on {counts[0]} GPU "
                      f"and {last['ratios_vs_eager']['kernelize_before']['tokens_per_s']:.2f}x on {counts[-1]}: per "
                      f"GPU it keeps {k_eff:.2f} of its {counts[0]}-GPU throughput, eager {e_eff:.2f}. Why the "
                      "kernelized step scales worse under FSDP2, and the set-up that keeps more of the gain: "
                      "[Integrations, FSDP2](integrations.md#fsdp2).", ""]
    if chart_dir is not None:
        parts += [f"![{stem}]({chart_dir}/{stem}.svg)", ""]
    return parts


_ACCOUNTING = (("gemm", "GEMMs"), ("attention", "attention"), ("fsdp2_copies", "FSDP2 copies"), ("adamw", "AdamW"),
               ("kernels", "Triton kernels (kernelize's, Liger's)"), ("inductor", "Inductor's kernels"),
               ("copies", "copies, fills"), ("other", "other"), ("nccl", "NCCL (beside the rest)"))


def _step_accounting(accounting: dict | None) -> list[str]:
    """A profiled step's GPU time per category and the bound it sets (``step_accounting`` of a distributed file)."""
    if not accounting:
        return []
    by = accounting["by_variant_ms"]
    rows = [(f"`{name}`", f"{ms['step_ms']:.1f}", *(f"{ms.get(key, 0.0):.1f}" for key, _ in _ACCOUNTING))
            for name, ms in by.items()]
    return [f"{accounting['what'][0].upper()}{accounting['what'][1:]}:", "",
            markdown_table(("variant", "step ms", *(label for _, label in _ACCOUNTING)), rows), "",
            f"Alone, these GEMMs take {accounting['gemm_floor_ms']:.1f} ms, attention "
            f"{accounting['attention_floor_ms']:.1f} ms and the memory-bound work "
            f"{accounting['memory_bound_floor_ms']:.1f} ms at HBM bandwidth. Bound for the kernelized step: "
            f"{accounting['kernelized_bound_ms']:.1f} ms, {accounting['bound_vs_eager']:.2f}x eager's step"
            # step_accounting writes a Liger ratio only where the run profiled a Liger row.
            + (f" and {accounting['bound_vs_liger']:.2f}x Liger's." if "bound_vs_liger" in accounting else "."), ""]


def _localstep_and_trace(runs: list[tuple[int, dict]]) -> list[str]:
    """The optimizer-path A/B (``--localstep-ab``) and traced-step (``--trace``) tables of a distributed file."""
    ab, traced = [], []
    for _, run in runs:
        for name, row in run.get("variants", {}).items():
            if row.get("localstep_ab"):
                a = row["localstep_ab"]
                each = ", ".join(f"{r:.2f}" for r in a["local_over_dtensor_each_round"])
                ab.append((f"`{name}`", f"{a['median_tokens_per_s']['dtensor']:,}",
                           f"{a['median_tokens_per_s']['local']:,}", f"**{a['local_over_dtensor_median']:.2f}x**",
                           f"{a['rounds']} x {a['steps_per_block']} steps: {each}"))
            if row.get("trace_one_step"):
                t = row["trace_one_step"]
                traced.append((f"`{name}`", f"{row['step_ms']:.1f}", f"{t['wall_ms']:.1f}", f"{t['gpu_busy_ms']:.1f}",
                               f"{t['gpu_idle_ms']:.1f}"))
    parts = []
    if ab:
        parts += ["The same model and optimizer in one process, AdamW through DTensor dispatch against AdamW on the "
                  "local shards (`kernels_core.optim.step_on_local_shards`), in alternating blocks, the order flipped "
                  "each round:", "",
                  markdown_table(("variant", "DTensor step tok/s", "local step tok/s", "local / DTensor (median)",
                                  "rounds, each round's ratio"), ab), ""]
    if traced:
        parts += ["One more step of each variant under torch.profiler: the GPU's busy time (kernels, copies; streams "
                  "merged) against the traced step's wall time; the untimed step is the timed rounds' median:", "",
                  markdown_table(("variant", "step ms", "traced step ms", "GPU busy ms", "GPU idle ms"), traced), ""]
    return parts


def models_title(data: dict) -> str:
    if data.get("what"):
        return str(data["what"])
    models = dict.fromkeys(MODEL_NAMES.get(row["model"], row["model"]) for row in data.get("rows", []))
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


def models_section(stem: str, data: dict, chart_dir: str | None) -> list[str]:
    parts = [f"## {models_title(data)} (`{stem}.json`)", "",
             f"{device_of(data)}, commit `{commit_of(data)}`; {data.get('config', '')}. "
             f"`benchmarks/cuda/models_bench.py`. {data.get('note', '')}".rstrip(), "",
             markdown_table(("model", "variant", "tokens/s", "vs eager", "vs compile", "peak GiB", "first step s",
                             "prepare + first step s"),
                            ((row["model"], f"`{row['variant']}`",
                              f"{row['tokens_per_s']:,}" if row.get("tokens_per_s")
                              else "failed: " + (row.get("error") or row.get("process_error") or "?")[:60],
                              row.get("speed_vs_eager", "-"), row.get("speed_vs_compile", "-"),
                              f"{row['peak_GiB']:.1f}" if row.get("peak_GiB") else "-",
                              f"{row['first_step_s']:.1f}" if row.get("first_step_s") else "-",
                              f"{row['to_first_step_s']:.1f}" if row.get("to_first_step_s") is not None else "-")
                             for row in data["rows"])), ""]
    floored = [row for row in data["rows"] if row.get("floor_fraction") is not None]
    if floored:
        parts += ["The step's floor from measured parts (`benchmarks/cuda/floor.py`, see "
                  "[Floor accounting](#floor-accounting)), in ms:", "",
                  markdown_table(("model", "variant", "step", "floor", "floor / step", "GEMMs", "attention",
                                  "memory-bound", "FP8 casts", "AdamW", "GPU idle"),
                                 ((row["model"], f"`{row['variant']}`", f"{row['step_ms']:.1f}",
                                   f"{row['floor_ms']:.1f}", f"{row['floor_fraction']:.0%}",
                                   *(f"{row['floor']['breakdown_ms'][key]:.1f}" for key in
                                     ("gemm", "attention", "memory_bound", "fp8_casts", "optimizer")),
                                   f"{row['gpu_idle_ms']:.1f}" if row.get("gpu_idle_ms") is not None else "-")
                                  for row in floored)), ""]
    # Only where there are expert GEMMs to set apart (MoE shapes).
    profiled = [row for row in data["rows"] if row.get("profile_one_step")
                and any("GroupProblem" in k["kernel"] for k in row["profile_one_step"])]
    if profiled:
        split = {id(row): _profile_split(row["profile_one_step"]) for row in profiled}
        parts += ["GPU time of one profiled step (ms), per kernel group:", "",
                  markdown_table(("model", "variant", "all kernels", "grouped expert GEMMs", "fused AdamW",
                                  "share of both"),
                                 ((row["model"], f"`{row['variant']}`", f"{total:.1f}", f"{grouped:.1f}",
                                   f"{adamw:.1f}", f"{(grouped + adamw) / total:.0%}")
                                  for row in profiled for total, grouped, adamw in [split[id(row)]])), ""]
        for model in dict.fromkeys(row["model"] for row in profiled):
            fixed = [split[id(row)] for row in profiled if row["model"] == model]
            both = [grouped + adamw for _, grouped, adamw in fixed]
            shares = [(grouped + adamw) / total for total, grouped, adamw in fixed]
            if len(both) > 1 and max(both) / min(both) < 1.1:
                parts += [f"{MODEL_NAMES.get(model, model)}: the grouped expert GEMMs and the fused AdamW take "
                          f"{min(both):.0f}-{max(both):.0f} ms in every variant, {min(shares):.0%}-{max(shares):.0%} "
                          "of the step's GPU time; the variants differ in the rest.", ""]
    if chart_dir is not None:
        parts += [f"![{stem}]({chart_dir}/{stem}.svg)", ""]
    return parts


def _vs(row: dict) -> str:
    """A decode row's speed against its baseline (eager, or compile for kernelize + compile)."""
    for key, base in (("speed_vs_compile", "compile"), ("speed_vs_eager", "eager")):
        if key in row:
            return "baseline" if row["variant"] == base else f"{row[key]:.2f}x {base}"
    return "-"


def decode_ab_section(stem: str, data: dict, bindings: dict[str, str]) -> list[str]:
    """``decode_bench.py --alternate``: both compiled variants in one process per model, per-round ratios.

    ``bindings`` maps a model to kernelize's report summary for ``kernelize_compile`` (``decode-h100.json``).
    """
    parts = [f"## Decoding, `torch.compile` against kernelize + compile in one process (`{stem}.json`)", "",
             f"{data.get('what', '')}: {device_of(data)}, commit `{commit_of(data)}`; {data.get('config', '')}.", ""]
    runs: dict[tuple, list[float]] = {}
    for row in data["rows"]:
        runs.setdefault((row["model"], row["batch"], row["variant"]), []).append(row["ms_per_token"])
    spread = max((max(v) / min(v) - 1 for v in runs.values() if len(v) > 1), default=0.0)
    if spread:
        parts += [f"One variant's own rounds in one process differ by up to {spread:.0%} in ms per token.", ""]
    parts += _decode_ab_binding(data, bindings)
    for model, error in data.get("errors", {}).items():
        parts += [f"{model} stopped early ({error.split(';')[0]}): its finished rounds are shown.", ""]
    parts += [markdown_table(("cell", "kernelize + compile vs compile, per round", "median"),
                             ((cell, ", ".join(f"{r:.2f}x" for r in result["kernelize_compile_vs_compile_per_round"]),
                               f"{result['median']:.2f}x") for cell, result in data["summary"].items())), ""]
    return parts


def _decode_ab_binding(data: dict, bindings: dict[str, str]) -> list[str]:
    # What kernelize bound for the A/B's models, read from decode-h100.json's kernelize_compile rows; the sentence
    # on the graph holds only while the causal-mask kernel is all that is bound.
    models = dict.fromkeys(row["model"] for row in data["rows"])
    known = {model: bindings[model] for model in models if model in bindings}
    if not known:
        return []
    cells = "; ".join(f"{model}: {summary.partition(': ')[2]}" for model, summary in known.items())
    parts = [f"What kernelize bound in this mode (`decode-h100.json`): {cells}.", ""]
    kernels = {kernel for summary in known.values() for kernel in re.findall(r"([\w.]+) x\d+", summary)}
    if len(known) == len(models) and kernels and all(k.startswith("any.causal_mask.") for k in kernels):
        parts += ["With a filled cache the causal-mask kernel calls transformers' own mask function, so the traced "
                  "decode step is compile's graph (checked on CPU with `TORCH_LOGS=graph_code`: the same operations, "
                  "its inputs in another order): these ratios show the spread of host-bound `generate`, not a "
                  "kernel.", ""]
    return parts


def decode_section(data: dict, chart_dir: str | None) -> list[str]:
    parts = ["## Decoding (`decode-h100.json`)", "", f"{data.get('what', '')}: {device_of(data)}, commit "
             f"`{commit_of(data)}`; {data.get('config', '')}.", ""]
    spreads = [max(r) / min(r) - 1 for r in (row.get("ms_per_token_rounds", ()) for row in data["rows"]) if len(r) > 1]
    if spreads:
        parts += [f"Decoding at these sizes is host-bound: processes of one variant differ by up to "
                  f"{max(spreads):.0%} in ms per token here, so a cell's figure is the median of its processes and "
                  "differences below that spread are noise.", ""]
    lookups = [(row, op) for row in data["rows"] for op in row.get("profile", ())
               if op["op"] == "TorchDynamo Cache Lookup" and op["calls"]]
    if lookups:
        cells = "; ".join(f"{row['model']} batch {row['batch']} `{row['variant']}` "
                          f"{op['cpu_self_ms'] / op['calls']:.2f} ms" for row, op in lookups)
        parts += ["Dynamo's guard check per compiled decoding step (`TorchDynamo Cache Lookup`, profiled in the first "
                  f"process): {cells}.", ""]
    parts += [markdown_table(("model", "cache", "batch", "variant", "ms/token", "each process", "vs baseline"),
                             ((row["model"], row["cache"], row["batch"], f"`{row['variant']}`",
                               f"{row['ms_per_token']:.2f}",
                               ", ".join(f"{ms:.2f}" for ms in row.get("ms_per_token_rounds", ())), _vs(row))
                              for row in data["rows"])), ""]
    if chart_dir is not None:
        parts += [f"![decode]({chart_dir}/decode-h100.svg)", ""]
    return parts
