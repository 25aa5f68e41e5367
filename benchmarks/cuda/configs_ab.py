"""Kernelized training tokens/s on published model shapes, A/B between sides that differ only in their environment.

Each (round, shape, side) is one fresh process; the sides alternate within a round and swap order every round, so
drift on the machine reaches both alike. Shapes are published configs written out here (no downloads), cut to a
few layers, random weights, bf16, sdpa attention, fused AdamW, batch 4 x 2048; each process kernelizes for
training (with ``--compile``, for training under ``torch.compile``, and compiles the model), runs warm-up steps,
then times ``--steps`` steps.

A side is ``NAME`` or ``NAME:VAR=VALUE[,VAR=VALUE...]``; ``PYTHONPATH`` values are put in front of the current
one, so a side can run another source tree (for example a copy of a package before a change):

    python -m benchmarks.cuda.configs_ab --sides on:KERNELS_X=1 off:KERNELS_X=0 --out benchmarks/results/x.json
    python -m benchmarks.cuda.configs_ab --shapes qwen3-0.6b --rounds 5 \\
        --sides before:PYTHONPATH=.abtree/triton:.abtree/cuda after --out benchmarks/results/y.json

``--layout packed`` (or ``mixed``) sends the 8,192 tokens of a step as one packed row of documents instead
(``packing_bench``'s layouts), for an A/B of the packed-attention path. A side that sets ``CONFIGS_AB_LAYOUT``
uses that layout instead of ``--layout``, so one A/B can set packed rows against unpacked ones on the same tree:

    python -m benchmarks.cuda.configs_ab --shapes qwen3-0.6b \
        --sides packed:CONFIGS_AB_LAYOUT=packed unpacked:CONFIGS_AB_LAYOUT=unpacked --out /tmp/packed-vs-unpacked.json

With ``--name``, the output file holds one named run per A/B (``runs``) and the run of that name is replaced or
added, so one file per device keeps every current A/B (``benchmarks/results/configs-ab-h100.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time
import traceback
from collections.abc import Callable

from benchmarks.common import FAMILIES
from benchmarks.common import causal_lm
from benchmarks.common import environment
from benchmarks.common import parse_side
from benchmarks.common import python_m
from benchmarks.common import require_cuda_kernels
from benchmarks.common import run_child
from benchmarks.common import settle_cpp_extension
from benchmarks.common import train_steps
from benchmarks.common import write_json


BATCH, SEQ = 4, 2048
LAYOUTS = ("unpacked", "packed", "mixed")
# A side's own layout (see the module docstring), read by its child process.
LAYOUT_VAR = "CONFIGS_AB_LAYOUT"

# Published configs (Hugging Face model cards' config.json), sizes only: rope scaling and generation settings do
# not change a training step's cost. "layers" is how many decoder layers are built.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {
        "model": "Qwen3ForCausalLM", "config": "Qwen3Config", "layers": 28,
        "kwargs": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6),
    },
    "llama-3.1-8b": {
        "model": "LlamaForCausalLM", "config": "LlamaConfig", "layers": 4,
        "kwargs": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5),
    },
    # Gemma-3-4B's text model: five sliding-window layers (1024 tokens) to one global one, so 6 layers hold one
    # of each kind in the published ratio.
    "gemma-3-4b": {
        "model": "Gemma3ForCausalLM", "config": "Gemma3TextConfig", "layers": 6,
        "kwargs": dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=256, vocab_size=262208, query_pre_attn_scalar=256, sliding_window=1024,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
    },
    "qwen3-30b-a3b": {
        "model": "Qwen3MoeForCausalLM", "config": "Qwen3MoeConfig", "layers": 4,
        "kwargs": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                       norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6),
    },
    "mixtral-8x7b": {
        "model": "MixtralForCausalLM", "config": "MixtralConfig", "layers": 2,
        "kwargs": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                       tie_word_embeddings=False),
    },
}


def build(shape: str):
    """The model of :data:`SHAPES` ``shape`` (random weights, bf16, on the GPU) and its vocabulary size."""
    spec = SHAPES[shape]
    (family,) = (name for name, classes in FAMILIES.items() if classes == (spec["config"], spec["model"]))
    model = causal_lm(family, device="cuda", **spec["kwargs"], num_hidden_layers=spec["layers"],
                      max_position_embeddings=4096)
    return model, model.config.vocab_size


def _wait_for_background_builds() -> str:
    """A kernels-triton tree that builds a C++ autograd extension in the background on first use (one side of an
    A/B) is timed once it is loaded, in its steady state; returns its status, or why it was not waited for.

    Only through the public ``kernels_triton.ops``: a side running a tree from before it (kernels-triton < 0.2) is
    timed as it comes, its status recorded as not waited for, and its first rounds may include the build.
    """
    import importlib.util

    if importlib.util.find_spec("kernels_triton") is None:
        return ""
    if importlib.util.find_spec("kernels_triton.ops") is None:
        return "not waited for: this kernels-triton has no public ops module (before 0.2)"
    return settle_cpp_extension()


def train(shape: str, steps: int, warmup: int, *, compile_model: bool = False, layout: str = "unpacked",
          host_batches: bool = False) -> dict:
    import kernels_core
    import kernels_triton
    import torch

    model, vocab = build(shape)
    model.train()
    if layout != "unpacked":
        # Packed rows as packing_bench sends them: eager (and so the kernelized model) attends per document only
        # without a cache.
        model.config.use_cache = False
    mode = kernels_core.Mode.TRAINING
    if compile_model:
        mode |= kernels_core.Mode.TORCH_COMPILE
    kernels_core.kernelize(model, mode=mode)
    report = kernels_core.get_report(model)
    require_cuda_kernels(report)
    extension = _wait_for_background_builds()

    if layout == "unpacked":
        gen = torch.Generator(device="cuda").manual_seed(1)
        batch = torch.randint(0, vocab, (BATCH, SEQ), device="cuda", generator=gen)
        real = batch.numel()
    else:
        from benchmarks.cuda.packing_bench import batch_for

        batch, real = batch_for(layout, vocab, "cuda")
    runner = torch.compile(model) if compile_model else model
    timed, _ = train_steps(runner, model.parameters(), batch, steps=steps, warmup=warmup,
                           from_host=torch.device("cuda") if host_batches else None)
    return {
        "train_tokens_per_s": steps * real / timed["seconds"],
        "train_step_ms": 1e3 * timed["seconds"] / steps,
        "train_peak_GiB": timed["peak_bytes"] / 2**30,
        "losses": timed["losses"],
        "kernels_triton": str(pathlib.Path(kernels_triton.__file__).parent),
        "cpp_extension": extension,
        "binding": report.summary(),
    }


def side_environment(changes: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for var, value in changes.items():
        if var == "PYTHONPATH":
            value = os.pathsep.join(str(pathlib.Path(p).resolve()) for p in value.split(os.pathsep))
            value = os.pathsep.join(filter(None, (value, env.get("PYTHONPATH", ""))))
        env[var] = value
    return env


def summarise(rows: list[dict], sides: list[str]) -> dict:
    """Per shape: each side's tokens/s per round and median, and the first side over each other side (median of
    the per-round ratios, and the ratio of the medians)."""
    summary: dict = {}
    for shape in dict.fromkeys(row["shape"] for row in rows):
        per_side = {side: {row["round"]: row["train_tokens_per_s"] for row in rows
                           if row["shape"] == shape and row["side"] == side and "train_tokens_per_s" in row}
                    for side in sides}
        entry: dict = {side: {"rounds": [round(v) for v in values.values()],
                              "median": round(statistics.median(values.values())) if values else None}
                       for side, values in per_side.items()}
        first = sides[0]
        for other in sides[1:]:
            paired = [per_side[first][r] / per_side[other][r] for r in per_side[first] if r in per_side[other]]
            if paired:
                entry[f"{first}/{other}"] = {
                    "median_of_round_ratios": round(statistics.median(paired), 4),
                    "round_ratios": [round(p, 4) for p in paired],
                    "ratio_of_medians": round(entry[first]["median"] / entry[other]["median"], 4),
                }
        summary[shape] = entry
    return summary


def store(out: pathlib.Path, payload: dict, name: str | None,
          write_json: Callable[[pathlib.Path, dict], None]) -> None:
    """Write ``payload`` to ``out``, or with a ``name`` as that run among the file's named ``runs``."""
    if name is None:
        write_json(out, payload)
        return
    existing = json.loads(out.read_text()) if out.exists() else {}
    runs = [run for run in existing.get("runs", []) if run.get("name") != name] + [{"name": name, **payload}]
    write_json(out, {"what": "kernelized training step, A/B between sides that differ only in their environment, "
                             "one named run per change measured (benchmarks/cuda/configs_ab.py)",
                     "environment": payload["environment"], "runs": runs})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--sides", nargs="+", default=[], help="NAME[:VAR=VALUE,...], two or more")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=180, help="seconds per process")
    parser.add_argument("--budget", type=float, default=0, help="seconds: start no process after this (0: none)")
    parser.add_argument("--commit", default="", help="recorded in the output")
    parser.add_argument("--what", default="", help="recorded in the output")
    parser.add_argument("--name", help="store the A/B as the run of this name in --out, beside its other runs")
    parser.add_argument("--compile", action="store_true",
                        help="kernelize with Mode.TORCH_COMPILE and time torch.compile(model)")
    parser.add_argument("--layout", choices=LAYOUTS, default="unpacked",
                        help="unpacked: batch 4 x 2048; packed: those 4 documents in one row (restarting position "
                             "ids, no cache: attention per document); mixed: documents of 64-4,096 tokens in one "
                             "row (packing_bench's layouts; tokens/s counts real tokens); a side's "
                             f"{LAYOUT_VAR} overrides it")
    parser.add_argument("--host-batches", action="store_true",
                        help="keep each step's batch in pinned host memory and copy it to the GPU every step, "
                             "blocking, as the Trainer's data loader does (the host then waits for the GPU once a "
                             "step)")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shape, out = args.child
        layout = os.environ.get(LAYOUT_VAR, args.layout)
        try:
            if layout not in LAYOUTS:
                raise ValueError(f"{LAYOUT_VAR}={layout!r}: expected one of {LAYOUTS}")
            result = {"layout": layout,
                      **train(shape, args.steps, args.warmup, compile_model=args.compile, layout=layout,
                             host_batches=args.host_batches)}
        except Exception as exc:  # noqa: BLE001 - a failing shape is a result to report
            result = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}
        pathlib.Path(out).write_text(json.dumps(result))
        return
    shapes = args.shapes.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; expected some of {sorted(SHAPES)}")
    sides = [parse_side(text) for text in args.sides]
    if len(sides) < 2 or args.out is None:
        raise SystemExit("--out and two or more --sides are required")
    rows: list[dict] = []
    began = time.perf_counter()
    how = "kernelize(Mode.TRAINING)"
    if args.compile:
        how = "kernelize(Mode.TRAINING | Mode.TORCH_COMPILE), torch.compile"
    payload = {"what": args.what, "commit": args.commit, "environment": environment(),
               "setup": f"{how}, bf16, sdpa, AdamW(fused), batch {BATCH}x{SEQ} ({args.layout}), "
                        f"{args.warmup} warm-up + {args.steps} timed steps per process"
                        + (", each step's batch copied from pinned host memory" if args.host_batches else ""),
               "shapes": {name: {k: v for k, v in SHAPES[name].items()} for name in shapes},
               "sides": dict(sides), "rows": rows}
    runs = [(round_index, shape, side) for round_index in range(args.rounds) for shape in shapes
            for side in (sides if round_index % 2 == 0 else sides[::-1])]
    for round_index, shape, (name, changes) in runs:
        if args.budget and time.perf_counter() - began > args.budget:
            print(f"budget of {args.budget:.0f} s reached: {len(rows)} of {len(runs)} processes ran",
                  flush=True)
            break
        tmp = args.out.with_name(f".{shape}.{name}.json")
        cmd = python_m("benchmarks.cuda.configs_ab", "--child", shape, str(tmp), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--layout", args.layout,
                       *(["--host-batches"] if args.host_batches else []),
                       *(["--compile"] if args.compile else []))
        row = {"round": round_index, "shape": shape, "side": name}
        result, error = run_child(cmd, tmp, timeout=args.timeout, env=side_environment(changes))
        row.update(result or {})
        if error:
            row["process_error"] = error
        rows.append(row)
        shown = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                 if k not in ("losses", "traceback", "binding", "kernels_triton")}
        print(json.dumps(shown), flush=True)
        payload["summary"] = summarise(rows, [n for n, _ in sides])
        store(args.out, payload, args.name, write_json)
    print(json.dumps(payload["summary"], indent=1), flush=True)


if __name__ == "__main__":
    main()
