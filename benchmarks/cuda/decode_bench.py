"""Greedy decoding through ``model.generate``: milliseconds per generated token, eager against kernelize, compile
and kernelize + compile, on the Qwen3-0.6B shape and the Llama-3.1-8B shape cut to 4 layers (random weights, bf16),
batch 1 and 8, dynamic and static cache. Each (model, variant) runs in a fresh process, ``--rounds`` times in
alternating order; a cell's figure is the median over its rounds (one process's decode speed varies by up to
10% from the next one's, more than most differences between variants).

    python -m benchmarks.cuda.decode_bench --models llama-3.1-8b-4l --out benchmarks/results/decode-h100.json
    python -m benchmarks.cuda.decode_bench --models qwen3-0.6b --add --out benchmarks/results/decode-h100.json

``--alternate`` measures compile against kernelize + compile (static cache) in one process per model instead,
alternating ``--rounds`` times, kernelizing and unkernelizing the same model in place with Dynamo reset before each
switch: both sides then share the process's host conditions.

    python -m benchmarks.cuda.decode_bench --alternate --rounds 4 --out benchmarks/results/decode-compile-ab-h100.json

``--add`` keeps the rows already in ``--out`` for cells (model, variant, cache, batch) this run does not measure,
when they were measured at the same commit on the same device, so one file can be filled by several shorter runs.

Variants: ``eager``; ``kernelize`` (``Mode.INFERENCE``); ``compile`` and ``kernelize_compile`` (``Mode.INFERENCE |
Mode.TORCH_COMPILE``). Without compile, generate's own compilation is switched off (``disable_compile``). With
compile, the dynamic cache runs ``torch.compile(model.forward)``; the static cache runs generate's own compiled
forward (transformers compiles it with CUDA graphs when the cache is static). ``--profile`` adds, per variant and
batch, the host time per operator of a few decode steps (where a fixed per-call cost shows).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback

import torch

from benchmarks.common import QWEN3_0_6B
from benchmarks.common import causal_lm
from benchmarks.common import environment
from benchmarks.common import pyplot
from benchmarks.common import python_m
from benchmarks.common import run_child
from benchmarks.common import write_json


MODELS = {
    "qwen3-0.6b": dict(family="qwen3", **{**QWEN3_0_6B, "max_position_embeddings": 40960}),
    "llama-3.1-8b-4l": dict(
        family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}
VARIANTS = ["eager", "kernelize", "compile", "kernelize_compile"]


def build(name: str, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, layers: int | None = None,
          **overrides):
    """A randomly initialised model of one of :data:`MODELS` (``overrides``: smaller sizes for tests)."""
    spec = dict(MODELS[name])
    family = spec.pop("family")
    spec.update(overrides)
    if layers is not None:
        spec["num_hidden_layers"] = layers
    return causal_lm(family, device=device, dtype=dtype, **spec).eval()


def prepare(model, variant: str) -> str:
    """Apply ``variant`` to ``model`` in place; returns what was bound."""
    how = ""
    if variant.startswith("kernelize"):
        import kernels_core

        mode = kernels_core.Mode.INFERENCE
        if variant.endswith("compile"):
            mode |= kernels_core.Mode.TORCH_COMPILE
        kernels_core.kernelize(model, mode=mode)
        how = kernels_core.get_report(model).summary()
    return how


def generate_kwargs(cache: str, variant: str, new_tokens: int) -> dict:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    compiled = variant.endswith("compile")
    # generate compiles the forward by itself for a static cache; only the compile variants may.
    kwargs["disable_compile"] = not (compiled and cache == "static")
    return kwargs


def _profile(model, ids, kwargs) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        torch.cuda.synchronize()
    rows = [{"op": e.key[:100], "calls": e.count, "cpu_self_ms": round(e.self_cpu_time_total / 1e3, 3),
             "cpu_total_ms": round(e.cpu_time_total / 1e3, 3), "gpu_ms": round(e.device_time_total / 1e3, 3)}
            for e in prof.key_averages()]
    rows.sort(key=lambda r: -r["cpu_self_ms"])
    return rows[:30]


def _prompt_ids(model, batch: int, prompt: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(batch)
    return torch.randint(1, model.config.vocab_size, (batch, prompt), device="cuda", generator=gen)


def _time_generate(model, ids: torch.Tensor, kwargs: dict, *, new_tokens: int, repeats: int) -> dict:
    """The first generate's seconds, then the median of ``repeats`` generates with the prefill taken out."""
    prompt = ids.shape[1]
    with torch.no_grad():
        start = time.perf_counter()
        first = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - start
        print(f"  first generate {first_s:.2f} s", file=sys.stderr, flush=True)
        model.generate(ids, **kwargs)  # a static cache's graphs are recorded over the first calls
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        # Prefill alone, to take it out of the per-token figure.
        pre = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, **{**kwargs, "max_new_tokens": 1, "min_new_tokens": 1})
            torch.cuda.synchronize()
            pre.append(time.perf_counter() - start)
    total, prefill = statistics.median(times), statistics.median(pre)
    return {
        "first_generate_s": round(first_s, 2), "generate_s": round(total, 4), "prefill_s": round(prefill, 4),
        "ms_per_token": round(1e3 * (total - prefill) / (new_tokens - 1), 3),
        "tokens_head": out[0, prompt:prompt + 8].tolist(),
        "same_tokens_first_and_last": bool(torch.equal(first, out)),
    }


def run_alternating(model_name: str, *, batches: list[int], new_tokens: int, prompt: int, repeats: int,
                    rounds: int, out: pathlib.Path) -> None:
    """``compile`` and ``kernelize_compile`` (static cache) on one model in one process, alternating A B B A ...:
    kernelize and unkernelize in place, Dynamo reset before each switch, so both sides share the process's host
    conditions, which differ more from one process to the next than the two sides differ. The rows go to ``out``
    after each measurement: a run stopped by its time limit keeps its finished rounds."""
    import kernels_core

    model = build(model_name)
    mode = kernels_core.Mode.INFERENCE | kernels_core.Mode.TORCH_COMPILE
    rows = []
    for round_index in range(rounds):
        order = ("compile", "kernelize_compile") if round_index % 2 == 0 else ("kernelize_compile", "compile")
        for variant in order:
            torch._dynamo.reset()
            if variant == "kernelize_compile":
                kernels_core.kernelize(model, mode=mode)
            else:
                kernels_core.unkernelize(model)
            for batch in batches:
                print(f"{model_name} round {round_index} {variant} batch {batch}", file=sys.stderr, flush=True)
                timed = _time_generate(model, _prompt_ids(model, batch, prompt),
                                       generate_kwargs("static", variant, new_tokens), new_tokens=new_tokens,
                                       repeats=repeats)
                rows.append({"model": model_name, "round": round_index, "variant": variant, "batch": batch, **timed})
                out.write_text(json.dumps(rows))


def _alternating_summary(rows: list[dict]) -> dict:
    """Per (model, batch): each round's kernelize_compile / compile speed ratio and their median."""
    ms = {(r["model"], r["batch"], r["round"], r["variant"]): r["ms_per_token"] for r in rows}
    summary = {}
    for model, batch in sorted({(r["model"], r["batch"]) for r in rows}):
        ratios = [round(ms[model, batch, i, "compile"] / ms[model, batch, i, "kernelize_compile"], 3)
                  for i in sorted({r["round"] for r in rows})
                  if (model, batch, i, "compile") in ms and (model, batch, i, "kernelize_compile") in ms]
        summary[f"{model} batch {batch}"] = {"kernelize_compile_vs_compile_per_round": ratios,
                                             "median": round(statistics.median(ratios), 3) if ratios else None}
    return summary


def run_variant(model_name: str, variant: str, *, batches: list[int], caches: list[str], new_tokens: int,
                prompt: int, repeats: int, profile: bool) -> list[dict]:
    model = build(model_name)
    how = prepare(model, variant)
    if variant.endswith("compile"):
        model.forward_uncompiled = model.forward
    rows = []
    for cache in caches:
        if variant.endswith("compile"):
            torch._dynamo.reset()
            model.forward = model.forward_uncompiled
            if cache == "dynamic":
                model.forward = torch.compile(model.forward_uncompiled)
        for batch in batches:
            row = {"model": model_name, "variant": variant, "cache": cache, "batch": batch, "binding": how}
            print(f"{model_name} {variant} {cache} batch {batch}", file=sys.stderr, flush=True)
            try:
                ids = _prompt_ids(model, batch, prompt)
                kwargs = generate_kwargs(cache, variant, new_tokens)
                row.update(_time_generate(model, ids, kwargs, new_tokens=new_tokens, repeats=repeats))
                if profile:
                    row["profile"] = _profile(model, ids, kwargs)
            except Exception as exc:  # noqa: BLE001 - a failing cell is a result to report
                row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
                row["traceback"] = traceback.format_exc()[-3000:]
            rows.append(row)
    if variant.endswith("compile"):
        from torch._dynamo.utils import counters

        for row in rows:
            row["dynamo_graph_breaks"] = sum(counters["graph_break"].values())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--caches", default="dynamic,static")
    parser.add_argument("--compile-caches", default="static",
                        help="caches for the compile variants (default: the static cache generate compiles for)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--compile-timeout", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3, help="processes per (model, variant), alternating")
    parser.add_argument("--add", action="store_true",
                        help="keep --out's rows of cells this run does not measure, if measured at this commit on "
                             "this device")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--alternate", action="store_true",
                        help="compile against kernelize_compile (static cache) in one process per model, --rounds "
                             "alternations of both; --out gets these rows and the per-round ratios")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    caches = args.caches.split(",")
    if args.child:
        model_name, variant = args.child.split(":")
        if variant == "alternate":
            run_alternating(model_name, batches=batches, new_tokens=args.new_tokens, prompt=args.prompt,
                            repeats=args.repeats, rounds=args.rounds, out=args.out)
            return
        if variant.endswith("compile"):
            caches = args.compile_caches.split(",")
        rows = run_variant(model_name, variant, batches=batches, caches=caches, new_tokens=args.new_tokens,
                           prompt=args.prompt, repeats=args.repeats, profile=args.profile)
        args.out.write_text(json.dumps(rows))
        return
    models, variants = args.models.split(","), args.variants.split(",")
    if args.alternate:
        _alternate(args, models)
        return
    by_cell: dict[tuple, list[dict]] = {}
    kept = []
    if args.add and args.out.exists():
        measured = {(m, v, c, b) for m in models for v in variants
                    for c in (args.compile_caches if v.endswith("compile") else args.caches).split(",")
                    for b in batches}
        kept = _kept_rows(json.loads(args.out.read_text()), environment(), measured)
    for round_index in range(args.rounds):
        # Alternating order: a slow drift of the machine lands on every variant alike.
        for model_name in models:
            for variant in variants if round_index % 2 == 0 else variants[::-1]:
                tmp = args.out.with_name(f".{model_name}-{variant}.json")
                cmd = _child_cmd(args, model_name, variant, tmp)
                cmd += ["--profile"] if args.profile and round_index == 0 else []
                limit = args.compile_timeout if variant.endswith("compile") else args.timeout
                got, error = run_child(cmd, tmp, timeout=limit)
                got = got or [{"model": model_name, "variant": variant}]
                if error:
                    got[-1]["process_error"] = error
                for row in got:
                    brief = {k: v for k, v in row.items()
                             if k not in ("profile", "traceback", "binding", "tokens_head")}
                    print(json.dumps({"round": round_index, **brief}), flush=True)
                    key = (row["model"], row["variant"], row.get("cache"), row.get("batch"))
                    by_cell.setdefault(key, []).append(row)
        # Written after every round: a run cut short by a time limit still leaves its finished rounds.
        _write(args, by_cell, kept, done=round_index + 1)


def _child_cmd(args: argparse.Namespace, model_name: str, variant: str, out: pathlib.Path) -> list[str]:
    """This script in a fresh process for one model and variant (``alternate``: both compiled ones), writing out."""
    return python_m("benchmarks.cuda.decode_bench", "--child", f"{model_name}:{variant}", "--out", str(out),
                    "--batches", args.batches, "--caches", args.caches, "--compile-caches", args.compile_caches,
                    "--new-tokens", str(args.new_tokens), "--prompt", str(args.prompt), "--repeats",
                    str(args.repeats), "--rounds", str(args.rounds))


def _alternate(args: argparse.Namespace, models: list[str]) -> None:
    rows, errors = [], {}
    for model_name in models:
        tmp = args.out.with_name(f".{model_name}-alternate.json")
        got, error = run_child(_child_cmd(args, model_name, "alternate", tmp), tmp, timeout=args.compile_timeout)
        rows += got or []
        if error:
            errors[model_name] = error
    summary = _alternating_summary(rows)
    for cell, result in summary.items():
        rounds = result["kernelize_compile_vs_compile_per_round"]
        print(f"{cell}: kernelize_compile vs compile {result['median']} (rounds {rounds})", flush=True)
    write_json(args.out, {
        "benchmark": "decode_bench --alternate",
        "what": "greedy generate with the static cache: torch.compile alone against kernelize + compile, alternating "
                "in one process per model (kernelize / unkernelize in place, Dynamo reset before each switch)",
        "environment": environment(),
        "config": f"prompt {args.prompt} tokens, {args.new_tokens} new tokens, bf16, sdpa, {args.rounds} rounds; "
                  "ms_per_token excludes the prefill; a round's ratio is compile's ms per token over "
                  "kernelize_compile's (above 1: kernelize + compile is faster)",
        "summary": summary,
        **({"errors": errors} if errors else {}),
        "rows": rows,
    })


def _write(args: argparse.Namespace, by_cell: dict[tuple, list[dict]], kept: list[dict], *, done: int) -> None:
    rows = kept + [_median_row(cell) for cell in by_cell.values()]
    _ratios(rows)
    write_json(args.out, {
        "benchmark": "decode_bench",
        "what": "greedy generate, ms per generated token with the prefill taken out, each (model, variant) in its "
                "own process",
        "environment": environment(),
        "config": f"greedy generate, prompt {args.prompt} tokens, {args.new_tokens} new tokens, bf16, sdpa; "
                  "ms_per_token excludes the prefill (a 1-token generate) and is the median over the row's processes "
                  "(ms_per_token_rounds)",
        "rows": rows,
    })
    _chart(rows, args.out.with_suffix(".png"))


def _median_row(rounds: list[dict]) -> dict:
    """One cell's row: the first round's (first generate cold, profile) with the median ms per token of all."""
    row = dict(rounds[0])
    values = [r["ms_per_token"] for r in rounds if r.get("ms_per_token")]
    if values:
        row["ms_per_token_rounds"] = values
        row["ms_per_token"] = round(statistics.median(values), 3)
    errors = [r[k] for r in rounds for k in ("error", "process_error") if r.get(k)]
    if errors and not values:
        row["error"] = errors[0]
    return row


def _kept_rows(previous: dict, env: dict, measured: set[tuple]) -> list[dict]:
    """Rows of ``previous`` (a file this script wrote) for cells not in ``measured``, if measured at this commit and
    device."""
    old_env = previous.get("environment", {})
    if (old_env.get("commit"), old_env.get("device")) != (env["commit"], env["device"]):
        print(f"--add: {old_env.get('commit')} on {old_env.get('device')} is not this run's commit and device; "
              "its rows are dropped", file=sys.stderr)
        return []
    return [row for row in previous.get("rows", [])
            if (row.get("model"), row.get("variant"), row.get("cache"), row.get("batch")) not in measured]


def _ratios(rows: list[dict]) -> None:
    """Speed of each row against its baseline (eager; compile for kernelize_compile), printed and stored."""
    index = {(r["model"], r["variant"], r.get("cache"), r.get("batch")): r for r in rows}
    for row in rows:
        base = "compile" if row["variant"] == "kernelize_compile" else "eager"
        ref = index.get((row["model"], base, row.get("cache"), row.get("batch")))
        if ref and row.get("ms_per_token") and ref.get("ms_per_token"):
            row[f"speed_vs_{base}"] = round(ref["ms_per_token"] / row["ms_per_token"], 3)
            print(f"{row['model']:16s} {row['cache']:8s} batch {row['batch']}: {row['variant']:18s} "
                  f"{row['ms_per_token']:7.2f} ms/token  {row[f'speed_vs_{base}']:.3f}x {base}", flush=True)


def _chart(rows: list[dict], path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    cells = sorted({(r["model"], r.get("cache"), r.get("batch")) for r in rows if r.get("ms_per_token")})
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cells)), 4.5))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        values = [next((r["ms_per_token"] for r in rows if (r["model"], r.get("cache"), r.get("batch")) == c
                        and r["variant"] == variant and r.get("ms_per_token")), 0) for c in cells]
        ax.bar([j + i * width for j in range(len(cells))], values, width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))])
    ax.set_xticklabels([f"{m}\n{c} b{b}" for m, c, b in cells], fontsize=8)
    ax.set_ylabel("ms per generated token (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
