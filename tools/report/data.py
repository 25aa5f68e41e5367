"""The results files as data for the report (:mod:`tools.report.generate`): loading, device and commit cells,
table formatting, the model names and which variants the README's headline shows.

Example:
    >>> thousands(71400.0), markdown_table(["a", "b"], [[1, 2]]).splitlines()[-1]
    ('71.4k', '| 1 | 2 |')
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


RESULTS = ROOT / "benchmarks" / "results"


def load_results(folder: Path = RESULTS) -> dict[str, dict]:
    """Every ``*.json`` under ``folder``, by file stem (``qwen3-h200``)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}


def env_of(data: dict) -> dict:
    return data.get("environment") or {}


def device_of(data: dict) -> str:
    env = env_of(data)
    return str(env.get("device") or data.get("device_name") or data.get("machine") or data.get("device") or "?")


def gpu_count(data: dict) -> int:
    """How many GPUs the run used (``environment.world_size``; 1 when not recorded)."""
    return int(env_of(data).get("world_size") or 1)


def short_device(data: dict, gpus: int | None = None) -> str:
    name = device_of(data)
    gpus = gpu_count(data) if gpus is None else gpus
    for short in ("H100", "H200"):
        if short in name:
            return f"{gpus}x {short}" if gpus > 1 else short
    return "CPU" if name in ("cpu", "x86_64", "?") or data.get("device") == "cpu" else name


def long_device(data: dict, gpus: int | None = None) -> str:
    gpus = gpu_count(data) if gpus is None else gpus
    return f"{gpus}x {device_of(data)}" if gpus > 1 else device_of(data)


def date_of(data: dict) -> str:
    return str(env_of(data).get("date") or data.get("date") or "?")[:10]


def commit_of(data: dict) -> str:
    return str(data.get("commit") or env_of(data).get("commit") or "?")


def commits_of(data: dict) -> str:
    """The commit of a file, or of each of its runs."""
    runs = data.get("runs")
    if not runs:
        return f"`{commit_of(data)}`"
    if isinstance(runs, dict):  # distributed_bench: one run per GPU count
        return ", ".join(f"`{commit_of(run)}` ({gpus} GPU{'s' if gpus != '1' else ''})" for gpus, run in runs.items())
    return ", ".join(f"`{commit_of(run)}` ({run['name']})" for run in runs)


def markdown_table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def thousands(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1000:.1f}k"


def row_where(data: dict, **match: object) -> dict:
    return next(row for row in data["rows"] if all(row.get(key) == value for key, value in match.items()))


MODEL_NAMES = {"qwen3-0.6b": "Qwen3-0.6B shape", "qwen3-30b-a3b-4l": "Qwen3-30B-A3B shape (4 layers)",
                "mixtral-8x7b-2l": "Mixtral-8x7B shape (2 layers)", "gemma-3-4b-6l": "Gemma-3-4B shape (6 layers)",
                "llama-3.1-8b-4l": "Llama-3.1-8B shape (4 layers)", "llama-3.1-8b": "Llama-3.1-8B shape (32 layers)",
                "granite-3-8b-4l": "Granite-3-8B shape (4 layers)",
                "deepseek-v2-lite-4l": "DeepSeek-V2-Lite shape (4 layers)"}


# The published depth of the shapes above that are cut to fewer layers.
_FULL_DEPTH = {"qwen3-30b-a3b-4l": 48, "mixtral-8x7b-2l": 32, "gemma-3-4b-6l": 34, "llama-3.1-8b-4l": 32,
               "granite-3-8b-4l": 40, "deepseek-v2-lite-4l": 27}


def bare_model_name(model: str) -> str:
    """A shape's name without the depth its default carries: ``Llama-3.1-8B shape (4 layers)`` -> ``Llama-3.1-8B
    shape``, for rows that state the depth they ran at, or none."""
    return re.sub(r" \(\d+ layers\)$", "", MODEL_NAMES.get(model, model))


def model_name(data: dict) -> str:
    """The shape's name, with the depth a run set (``distributed_bench.py --layers``) instead of the default's."""
    model = data.get("model", "?")
    runs = list((data.get("runs") or {}).values())
    layers = data.get("layers") or next((run.get("layers") for run in runs if run.get("layers")), None)
    if not layers:
        return MODEL_NAMES.get(model, model)
    depth = "full depth" if _FULL_DEPTH.get(model) == layers else f"{layers} layers"
    return bare_model_name(model) + f" ({depth})"


def fsdp_setup(data: dict) -> str:
    """The FSDP2 set-up a distributed_bench run departs from the default in (optimizer, layers per unit), or ""."""
    config = str(data.get("config") or next(iter((data.get("runs") or {}).values()), {}).get("config", ""))
    notes = ["foreach AdamW"] if "AdamW(foreach" in config else []
    unit = re.search(r"per (\d+) decoder layer", config)
    if unit and unit.group(1) != "1":
        notes.append(f"{unit.group(1)} layers per FSDP2 unit")
    return ", ".join(notes)


# models_bench results in the headline: (variant, baseline) pairs per file; the targets are set this way.
MODELS_HEADLINE = {"moe-h100": ("MoE training", (("kernelize", "eager"), ("kernelize_compile", "compile"))),
                   "gemma-h100": ("Training", (("kernelize", "compile"), ("kernelize_compile", "compile"))),
                   "granite-h200": ("Training", (("kernelize", "eager"), ("kernelize", "liger"),
                                                 ("kernelize_compile", "compile"))),
                   "deepseek-v2-lite-h200": ("MLA + MoE training", (("kernelize", "eager"),)),
                   "models-llama-3.1-8b-fp8-h200": ("Training with activation checkpointing",
                                                    (("fp8_tensorwise", "kernelize_compile"),
                                                     ("fp8_rowwise", "kernelize_compile")))}
# How the README names a models_bench variant where its name with " + " for "_" would not read.
VARIANT_NAMES = {"fp8_tensorwise": "kernelize + compile + FP8 (tensorwise)",
                 "fp8_rowwise": "kernelize + compile + FP8 (rowwise)"}
# How the README names each models_bench baseline.
BASELINES = {"eager": "eager", "compile": "`torch.compile`", "liger": "Liger-Kernel",
             "kernelize_compile": "kernelize + compile, bf16"}


# Results on the benchmarks page only: the README's table keeps one row per question (the others are repeats, the
# other optimizer, or a smaller GPU count of a shape measured on more).
PAGE_ONLY = {"distributed-repeats-fused-1xh200", "distributed-repeats-foreach-1xh200",
              "distributed-scaling-foreach-4xh200", "distributed-4-layers-per-unit-foreach-2xh200",
              # Its kernelize rows predate the recomputed gated-MLP product; distributed-llama-3.1-8b-2xh200 has
              # today's. Its kernelize + compile and FP8 rows stay on the page.
              "distributed-llama-3.1-8b-compile-fp8-2xh200",
              # A re-measurement of distributed-fsdp2-host-1xh200's first three variants (the same ratios within
              # their spread); that file keeps the headline rows and the compile variants.
              "distributed-fsdp2-recheck-1xh200",
              # Sharding settings (noreshard, prefetch): a recipe's measurement, described in the integrations page.
              "distributed-fsdp2-sharding-1xh200",
              # The local-shard optimizer step's in-process A/B and the traced steps behind the FSDP2 host
              # accounting: described in the benchmarks and integrations pages.
              "distributed-fsdp2-localstep-ab-1xh200", "distributed-fsdp2-trace-1xh200",
              # Superseded by distributed-llama-3.1-8b-profile-2xh200 (the same comparison with each step profiled).
              "distributed-llama-3.1-8b-2xh200",
              # FSDP2 experiments on one GPU behind the integrations page's recipe: CUDA graph trees (they re-record
              # every step), the same variants in another order on another host, and NCCL's SM share on two GPUs.
              "distributed-fsdp2-cudagraphs-1xh200", "distributed-fsdp2-repeat-1xh200",
              "distributed-llama-3.1-8b-nccl-ctas-2xh200"}


# The one-GPU FSDP2 recipes of the integrations page, as distributed_bench variants: (name, kernelize before
# fully_shard, kernelize after it).
FSDP2_RECIPES = (("eager mode", "kernelize_before+localstep+noreshard+prefetch2",
                  "kernelize_after+localstep+noreshard+prefetch2"),
                 ("per-layer compile", "kernelize_compile+localstep+noreshard+prefetch2+compilenative",
                  "kernelize_compile_after+localstep+noreshard+prefetch2+compilenative"))
# Each recipe (kernelized before fully_shard) and itself under a second name, modifiers in another order: the same
# code twice, an A/A pair.
FSDP2_RECIPE_AA = (("eager mode", "kernelize_before+localstep+noreshard+prefetch2",
                    "kernelize_before+noreshard+prefetch2+localstep"),
                   ("per-layer compile", "kernelize_compile+localstep+noreshard+prefetch2+compilenative",
                    "kernelize_compile+noreshard+prefetch2+localstep+compilenative"))


def fsdp2_recipe_runs(results: dict[str, dict]) -> list[dict]:
    """Every one-GPU distributed_bench run (a file, or one process of a file of several) with eager and a variant of
    :data:`FSDP2_RECIPES`: its file (and the file's ``what``), process, commit, rounds, eager tokens/s, and each
    variant's ratio to eager in tokens/s and peak memory.

    Example:
        >>> run = {"variants": {"eager": {"tokens_per_s": 100.0},
        ...                     FSDP2_RECIPES[0][1]: {"tokens_per_s": 150.0}}, "environment": {"commit": "abc"}}
        >>> [(r["file"], r["ratios"]) for r in fsdp2_recipe_runs({"distributed-x": run})]
        [('distributed-x', {'kernelize_before+localstep+noreshard+prefetch2': 1.5})]
    """
    names = {name for _, *pair in (*FSDP2_RECIPES, *FSDP2_RECIPE_AA) for name in pair}
    out = []
    for stem, data in results.items():
        if not stem.startswith("distributed-") or gpu_count(data) != 1:
            continue
        runs = [(None, data)] if data.get("variants") else []
        runs += list((data.get("processes") or {}).items())
        for process, run in runs:
            variants = run["variants"]
            eager = variants.get("eager", {}).get("tokens_per_s")
            ratios = {name: row["tokens_per_s"] / eager for name, row in variants.items()
                      if name in names and eager and row.get("tokens_per_s")}
            peak = variants.get("eager", {}).get("peak_GiB")
            if ratios:
                out.append({"file": stem, "what": data.get("what"), "process": process, "commit": commit_of(data),
                            "eager": eager,
                            "rounds": len(variants["eager"].get("tokens_per_s_each_round", [eager])),
                            "ratios": ratios, "peaks": {name: variants[name]["peak_GiB"] / peak for name in ratios
                                                        if peak and variants[name].get("peak_GiB")}})
    return out


# distributed_bench variants in the headline, with the baseline each is compared with.
DISTRIBUTED_HEADLINE = (("kernelize_before", "kernelize, then `fully_shard`", "eager"),
                         ("kernelize_before+localstep", "kernelize, then `fully_shard`, AdamW on local shards "
                          "(`KernelizeCallback`'s default)", "eager"),
                         ("kernelize_compile", "kernelize + compile, then `fully_shard`", "`torch.compile`"),
                         ("kernelize_compile+localstep+compilenative", "kernelize + compile per layer with the "
                          "elementwise kinds left to Inductor, then `fully_shard`", "`torch.compile`"))


def trainer_numbers(data: dict) -> tuple[dict[str, float], dict[str, float]]:
    """Steady tokens/s and peak GiB (per GPU) of every variant of a trainer_bench file that did not fail."""
    r = {name: v for name, v in data["results"].items() if "error" not in v}
    return ({name: v["steady_tokens_per_second"] for name, v in r.items()},
            {name: v["peak_memory_gib"] for name, v in r.items()})


def per_gpu_suffix(gpus: int) -> str:
    return "/GPU" if gpus > 1 else ""


def gpu_counts(data: dict) -> list[str]:
    """The GPU counts of a distributed_bench scaling file (its ``runs`` keys), smallest first."""
    return sorted(data.get("runs") or {}, key=int)
