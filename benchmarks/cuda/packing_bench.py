"""Packed rows against unpacked ones: the same documents, trained eager, with Liger, kernelized, compiled.

The Qwen3-0.6B shape (or ``--model``, a :data:`benchmarks.cuda.models_bench.MODELS` name), bf16, fused AdamW,
about 8,192 tokens a step, each (layout, variant) in a fresh process. Layouts:

- ``unpacked``: 4 rows of 2,048 tokens, no mask;
- ``packed``: the same 4 documents in one row of 8,192, position ids restarting at each document (as
  ``DataCollatorWithFlattening`` and TRL's ``padding_free`` send them), labels -100 at each document's start. The
  model's config has ``use_cache=False``, so eager transformers attends per document (through a dense
  ``[1, 1, 8192, 8192]`` mask);
- ``mixed``: documents of 64 to 4,096 tokens (drawn once, seeded) in one packed row of about 8,192 tokens;
- ``padded``: the same mixed documents one per row, padded to the longest, with an attention mask and labels -100
  on padding: what packing replaces. Its tokens/s counts real tokens only, as every layout's does.

Variants: ``eager``, ``liger``, ``kernelize``, ``compile``, ``kernelize_compile`` (as in models_bench).
``--interleave ROUNDS`` trains the unpacked and packed batches in one process per variant instead, in alternating
blocks of ``--steps`` steps, and reports their ratio per round: processes of one configuration spread by more
than 10% on a host-bound shape, which one process's rounds do not. ``--trace DIR`` keeps a Chrome trace of one
more step of each row, host threads and GPU.
``--agreement N`` adds, for the packed layout, N untimed steps of eager and of kernelize from the same weights,
with each step's loss (also on ``--agreement-model``, a sliding-window shape), to check the kernelized losses
against eager's in the same setting.

    python -m benchmarks.cuda.packing_bench --out benchmarks/results/packing-h200.json
    python -m benchmarks.cuda.packing_bench --layouts packed --variants eager,kernelize --steps 3 --out /tmp/p.json
    python -m benchmarks.cuda.packing_bench --interleave 8 --variants kernelize --steps 10 --out /tmp/ab.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
import traceback

import torch

from benchmarks.common import alternating_rounds
from benchmarks.common import environment
from benchmarks.common import host_profile_step
from benchmarks.common import profile_step
from benchmarks.common import python_m
from benchmarks.common import run_child
from benchmarks.common import trace_step
from benchmarks.common import train_steps
from benchmarks.common import write_json
from benchmarks.cuda.models_bench import MODELS
from benchmarks.cuda.models_bench import build
from benchmarks.cuda.models_bench import prepare


LAYOUTS = ("unpacked", "packed", "mixed", "padded")
VARIANTS = ("eager", "liger", "kernelize", "compile", "kernelize_compile")
DOCUMENT = 2048
TOKENS = 8192
# A sliding-window shape for the agreement check: Qwen3-0.6B with every other layer in a 512-token window, shorter
# than the documents, so the packed kernel computes banded documents there.
SLIDING = {"layer_types": ["sliding_attention", "full_attention"] * 14, "sliding_window": 512,
           "use_sliding_window": True, "max_window_layers": 0}


def mixed_lengths(total: int = TOKENS, *, seed: int = 0) -> list[int]:
    """Document lengths drawn uniformly from 64 to 4,096 tokens, the last cut so that they sum to ``total``.

    Example:
        >>> lengths = mixed_lengths(10_000)
        >>> sum(lengths), min(lengths) >= 1, max(lengths) <= 4096
        (10000, True, True)
    """
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(64, 4097, (1,), generator=generator)), total - sum(lengths)))
    return lengths


def batch_for(layout: str, vocab: int, device: str | torch.device) -> tuple[dict[str, torch.Tensor], int]:
    """The named inputs of one step, and how many of its tokens are real (not padding).

    Example:
        >>> batch, real = batch_for("packed", 100, "cpu")
        >>> batch["input_ids"].shape, real, batch["position_ids"][0, 2047:2049].tolist()
        (torch.Size([1, 8192]), 8192, [2047, 0])
    """
    lengths = [DOCUMENT] * (TOKENS // DOCUMENT) if layout in ("unpacked", "packed") else mixed_lengths()
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    if layout == "unpacked":
        ids = torch.stack(documents).to(device)
        return {"input_ids": ids, "labels": ids}, ids.numel()
    if layout == "padded":
        longest = max(lengths)
        ids = torch.zeros(len(documents), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, document in enumerate(documents):
            ids[row, : len(document)] = document
            mask[row, : len(document)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
                "labels": labels.to(device)}, sum(lengths)
    ids = torch.cat(documents)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(positions == 0, -100)  # no document predicts the next one's first token
    packed = {"input_ids": ids, "position_ids": positions, "labels": labels}
    return {name: tensor.to(device) for name, tensor in packed.items()}, ids.numel()


def _model(name: str, *, sliding: bool = False) -> torch.nn.Module:
    model = build(name, **(SLIDING if sliding else {}))
    model.config.use_cache = False  # eager attends per document on packed rows (see the module docstring)
    return model.train()


def train(model_name: str, layout: str, variant: str, *, steps: int, warmup: int, profile: bool = False,
          profile_top: int = 12, trace: pathlib.Path | None = None) -> dict:
    model = _model(model_name)
    runner, how = prepare(model, variant, [])
    batch, real = batch_for(layout, model.config.vocab_size, "cuda")
    timed, step = train_steps(runner, model.parameters(), batch, steps=steps, warmup=warmup + 1)
    result = {
        "tokens_per_s": round(steps * real / timed["seconds"]),
        "step_ms": round(1e3 * timed["seconds"] / steps, 2),
        "peak_GiB": round(timed["peak_bytes"] / 2**30, 2),
        "first_step_s": round(timed["first_step_s"], 2),
        "losses": [round(v, 4) for v in timed["losses"]],
        "binding": how,
    }
    if variant.endswith("compile"):
        from torch._dynamo.utils import counters

        result["dynamo_graph_breaks"] = sum(counters["graph_break"].values())
    if profile:
        result["profile_one_step"] = profile_step(step)
        host = host_profile_step(step, torch.device("cuda"), top=profile_top)
        result["host_one_step"] = {key: host[key] for key in ("host_ms", "wall_ms", "by_tottime", "by_cumtime")}
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        result["trace_one_step"] = trace_step(step, trace / f"trace-{layout}-{variant}.json.gz", top=profile_top)
    return result


def interleaved(model_name: str, variant: str, *, rounds: int, steps: int, warmup: int,
                host_batches: bool = False) -> dict:
    """Unpacked and packed batches of the same documents trained by one model in one process, in alternating
    blocks of ``steps`` steps (the order flips each round): their speed ratio without the spread between
    processes (autotuned configurations, allocator state, host placement), which at this shape is larger than the
    5% a packed-against-unpacked target asks to resolve. With ``host_batches`` every step copies its batch from
    pinned host memory, blocking, as the Trainer's data loader does."""
    import statistics

    model = _model(model_name)
    runner, how = prepare(model, variant, [])
    layouts = ("unpacked", "packed")
    batches, real = {}, {}
    for layout in layouts:
        batch, real[layout] = batch_for(layout, model.config.vocab_size, "cuda")
        batches[layout] = {name: t.cpu().pin_memory() for name, t in batch.items()} if host_batches else batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(layout: str) -> torch.Tensor:
        inputs = batches[layout]
        if host_batches:
            inputs = {name: t.to("cuda") for name, t in inputs.items()}
        loss = runner(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    for _ in range(warmup + 1):
        for layout in layouts:
            step(layout).item()
    first_s = time.perf_counter() - start
    peaks = dict.fromkeys(layouts, 0)

    def block(layout: str) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step(layout)
        torch.cuda.synchronize()
        speed = steps * real[layout] / (time.perf_counter() - start)
        peaks[layout] = max(peaks[layout], torch.cuda.max_memory_allocated())
        loss.item()
        return speed

    speeds = alternating_rounds(layouts, rounds=rounds, block=block)
    ratios = [p / u for p, u in zip(speeds["packed"], speeds["unpacked"], strict=True)]
    return {
        "variant": variant, "rounds": rounds, "steps_per_block": steps, "host_batches": host_batches,
        "warmup_s": round(first_s, 1), "binding": how,
        "tokens_per_s": {layout: [round(v) for v in speeds[layout]] for layout in layouts},
        "tokens_per_s_median": {layout: round(statistics.median(speeds[layout])) for layout in layouts},
        "packed_vs_unpacked_each_round": [round(r, 3) for r in ratios],
        "packed_vs_unpacked_median": round(statistics.median(ratios), 3),
        "peak_GiB": {layout: round(peaks[layout] / 2**30, 2) for layout in layouts},
    }


def agreement(model_name: str, *, steps: int, sliding: bool) -> dict:
    """Each step's loss of eager and of kernelize on the packed layout, from the same weights and data."""
    import copy

    import kernels_core

    eager = _model(model_name, sliding=sliding)
    kernelized = copy.deepcopy(eager)
    kernels_core.kernelize(kernelized, mode=kernels_core.Mode.TRAINING)
    batch, _ = batch_for("packed", eager.config.vocab_size, "cuda")
    losses = {}
    for name, model in (("eager", eager), ("kernelize", kernelized)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        losses[name] = []
        for _ in range(steps):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(round(loss.item(), 5))
    gaps = [abs(k - e) / abs(e) for e, k in zip(losses["eager"], losses["kernelize"], strict=True)]
    return {"losses": losses, "max_relative_gap": round(max(gaps), 6),
            "binding": kernels_core.get_report(kernelized).summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--skip", default="", help="comma-separated layout:variant rows to leave out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--agreement", type=int, default=0, help="steps of the eager/kernelize loss check (0: none)")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--profile", action="store_true",
                        help="add each train row's GPU time per kernel and host time of one more step")
    parser.add_argument("--profile-top", type=int, default=12,
                        help="with --profile: how many Python functions to keep, by own and by cumulative host time")
    parser.add_argument("--trace", type=pathlib.Path,
                        help="folder for a Chrome trace of one more step of each train row (host threads and GPU), "
                             "summarised in the row: blocking runtime calls, host ops by own time, GPU idle gaps")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="instead of one process per row: for each variant, one process training unpacked and "
                             "packed batches in ROUNDS alternating blocks of --steps steps (their ratio per round)")
    parser.add_argument("--host-batches", action="store_true",
                        help="with --interleave: every step copies its batch from pinned host memory, blocking")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, _, rest = args.child.partition(":")
        row: dict = {"model": args.model, "kind": kind, "what": rest}
        try:
            if kind == "train":
                layout, variant = rest.split("/")
                row.update(layout=layout, variant=variant)
                row.update(train(args.model, layout, variant, steps=args.steps, warmup=args.warmup,
                                 profile=args.profile, profile_top=args.profile_top, trace=args.trace))
            elif kind == "interleave":
                row.update(interleaved(args.model, rest, rounds=args.interleave, steps=args.steps,
                                       warmup=args.warmup, host_batches=args.host_batches))
            else:
                row.update(agreement(args.model, steps=args.agreement, sliding=rest == "sliding"))
        except Exception as exc:  # noqa: BLE001 - a failing row is a result to report
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            row["traceback"] = traceback.format_exc()[-3000:]
        args.out.write_text(json.dumps(row))
        return

    def child(what: str) -> dict:
        tmp = args.out.with_name(f".packing-{what.replace('/', '-').replace(':', '-')}.json")
        cmd = python_m("benchmarks.cuda.packing_bench", "--child", what, "--out", str(tmp), "--model", args.model,
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--agreement", str(args.agreement),
                       "--interleave", str(args.interleave), *(["--host-batches"] if args.host_batches else []),
                       "--profile-top", str(args.profile_top), *(["--profile"] if args.profile else []),
                       *(["--trace", str(args.trace.resolve())] if args.trace else []))
        start = time.perf_counter()
        result, error = run_child(cmd, tmp, timeout=args.timeout)
        row = result or {"what": what}
        if error:
            row["process_error"] = error
        row["process_s"] = round(time.perf_counter() - start, 1)
        quiet = ("traceback", "profile_one_step", "host_one_step", "trace_one_step")
        print(json.dumps({k: v for k, v in row.items() if k not in quiet}), flush=True)
        return row

    skip = set(filter(None, args.skip.split(",")))
    if args.interleave:
        rows = [child(f"interleave:{variant}") for variant in args.variants.split(",")]
    else:
        rows = [child(f"train:{layout}/{variant}") for layout in args.layouts.split(",")
                for variant in args.variants.split(",") if f"{layout}:{variant}" not in skip]
    checks = [child(f"agreement:{which}") for which in ("dense", "sliding")] if args.agreement else []
    _ratios(rows)
    write_json(args.out, {
        "environment": environment(),
        "config": f"{args.model} shape, bf16, sdpa, AdamW(fused), about {TOKENS} tokens a step, "
                  + (f"one process per variant: {args.interleave} rounds of {args.steps} unpacked and {args.steps} "
                     f"packed steps alternating (order flipped each round) after {args.warmup} warm-up steps and "
                     "the first of each" if args.interleave else
                     f"{args.steps} timed steps after {args.warmup} warm-up steps and the first")
                  + "; config.use_cache=False (eager attends per document on packed rows); tokens/s counts real "
                    "tokens",
        "rows": rows,
        "agreement": checks,
    })


def _ratios(rows: list[dict]) -> None:
    index = {(r.get("layout"), r.get("variant")): r for r in rows if r.get("tokens_per_s") and r.get("layout")}
    for row in rows:
        if not row.get("tokens_per_s") or not row.get("layout"):  # interleaved rows carry their own ratios
            continue
        layout, variant = row["layout"], row["variant"]
        # Against eager on the same layout, and against the same variant on the layout packing replaces.
        references = {"eager": (layout, "eager"), "compile": (layout, "compile")}
        if layout in ("packed", "mixed"):
            references["unpacked" if layout == "packed" else "padded"] = (
                "unpacked" if layout == "packed" else "padded", variant)
        for label, key in references.items():
            ref = index.get(key)
            if ref is not None and ref is not row:
                row[f"speed_vs_{label}"] = round(row["tokens_per_s"] / ref["tokens_per_s"], 3)
                row[f"peak_vs_{label}"] = round(row["peak_GiB"] / ref["peak_GiB"], 3)


if __name__ == "__main__":
    main()
