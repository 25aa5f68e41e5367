"""Training benchmark on published model shapes cut to a few layers: the MoE shapes Qwen3-30B-A3B (128 experts,
top-8), Mixtral-8x7B (8 experts, top-2) and DeepSeek-V2-Lite (multi-head latent attention, 64 routed experts top-6
plus 2 shared, built as transformers' DeepSeek-V3 architecture), and the dense Gemma-3-4B (sliding-window layers,
offset norms, GeGLU, 262k vocabulary), Llama-3.1-8B and Granite-3.0-8B (embedding, attention, residual and logit
multipliers). Random weights, bf16, AdamW, 2 x 4096 tokens. Each (model, variant) runs in a
fresh process; tokens/s over the timed steps, peak memory, and the first step's seconds (kernel compilation,
autotuning and torch.compile all land there).

    python -m benchmarks.cuda.models_bench --models qwen3-30b-a3b-4l,mixtral-8x7b-2l \
        --out benchmarks/results/moe-h100.json
    python -m benchmarks.cuda.models_bench --models gemma-3-4b-6l \
        --variants eager,liger,kernelize,compile,kernelize_compile --out benchmarks/results/gemma-h100.json

Variants: ``eager`` (transformers' default experts implementation, named in each row), ``hf_eager`` and
``hf_grouped_mm`` (``experts_implementation`` set explicitly, MoE shapes only), ``liger`` (Liger's model patch, as
the Trainer's ``use_liger_kernel`` applies it), ``kernelize``, ``compile``, ``kernelize_compile``,
``hf_grouped_mm_compile``, and ``fp8_rowwise`` / ``fp8_tensorwise``: kernelize + compile with every decoder-layer
linear projection in FP8 (``[kinds.linear] prefer``, kernels-cuda[fp8]; rows gain ``speed_vs_kernelize_compile``).
A suffix ``@name`` runs a variant again under another row name; a name starting with ``cold`` also gives its
process an empty Triton kernel cache, as the first run on a machine finds it (the other rows find the cache the
settling process and earlier rows filled, as every later run does), and ``@name:VAR=VALUE`` sets one environment
variable in its process (``kernelize@nowarm:KERNELS_TRITON_WARMUP=0``); a modifier ``+chunk<N>`` sets the fused
loss's token chunks to about N rows. Kernelize's own seconds are recorded apart from the first step's
(``kernelize_s``) and together with it (``to_first_step_s``: from the model's preparation to the end of its first
step). ``--profile`` adds the GPU time per kernel of one more step to each row, and that time by kind of kernel
(``profile_by_category_ms``: GEMMs, attention, AdamW, the Triton kernels, ...;
:func:`benchmarks.common.profile_by_category`).

Before the timed processes one untimed process per model trains a step kernelized and waits for kernels-triton's
C++ extension: the first pays what only a machine's first CUDA process pays (reading the CUDA
libraries from disk: its first step took 1.3-3 s longer than in the next, equal processes) and fills the caches.
``--rounds N`` runs the variant list N times, alternating; a row then holds the median of each measure and
every round's value (``<measure>_rounds``).

**Floor accounting** (:mod:`benchmarks.cuda.floor`, on by default, ``--no-floor`` skips it): one more process per
model times the step's parts alone on this machine (each GEMM shape with cuBLAS, attention with the SDPA backend
the model uses, memory-bound work and AdamW at the measured copy bandwidth, FP8 rows with FP8 products and their
casts) and every dense row gains ``floor_ms``, ``floor_fraction`` (floor / measured step) and ``floor`` (the
breakdown); with ``--profile`` also ``gpu_idle_ms`` (the step's time with no kernel running) and
``kernels_above_floor_ms``. MoE rows say that their floor is not modelled.

``llama-3.1-8b`` is the Llama-3.1-8B shape at its full depth (32 layers). ``--checkpointing`` turns on activation
checkpointing (transformers' ``gradient_checkpointing_enable``, non-reentrant) in every variant alike, and the
floor counts the recomputed forward. ``--compile-layers``: the compile variants compile each decoder layer alone
(one graph for all of them, as torchtitan does) instead of the whole model, so a 32-layer model compiles in about
one layer's time. The modifier ``+lm_head`` on an FP8 variant (``fp8_tensorwise+lm_head``) puts
``lm_head`` in FP8 too (``[kinds.linear] options = { lm_head = true }``; the fused loss then declines, so the loss
runs unfused). ``--device cpu --tiny`` runs every code path on a 2-layer model of each shape on the CPU (a smoke
test: nothing to read in its numbers; FP8 rows carry kernelize's refusal there).

    python -m benchmarks.cuda.models_bench --models llama-3.1-8b --checkpointing --tokens 2x4096 \
        --variants kernelize_compile,fp8_tensorwise,fp8_rowwise,fp8_tensorwise+lm_head --out /tmp/fp8-32l.json
    python -m benchmarks.cuda.models_bench --models qwen3-0.6b,llama-3.1-8b-4l --variants kernelize \
        --device cpu --tiny --tokens 1x64 --steps 1 --warmup 1 --out /tmp/models-smoke.json       # smoke test
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time
import traceback
from typing import Any

import torch

from benchmarks.common import causal_lm
from benchmarks.common import enable_checkpointing
from benchmarks.common import environment
from benchmarks.common import fp8_linear_config
from benchmarks.common import parse_side
from benchmarks.common import profile_by_category
from benchmarks.common import profile_step
from benchmarks.common import pyplot
from benchmarks.common import python_m
from benchmarks.common import run_child
from benchmarks.common import set_loss_chunk_rows
from benchmarks.common import settle_cpp_extension
from benchmarks.common import train_steps
from benchmarks.common import write_json
from benchmarks.cuda import floor


MODELS = {
    "qwen3-30b-a3b-4l": dict(
        family="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, tie_word_embeddings=False, norm_topk_prob=True, max_position_embeddings=40960,
    ),
    "mixtral-8x7b-2l": dict(
        family="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
        tie_word_embeddings=False, max_position_embeddings=32768,
    ),
    # Five sliding-window layers (1024 tokens) to one global one, as published: 6 layers hold one of each kind.
    "gemma-3-4b-6l": dict(
        family="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=262208, query_pre_attn_scalar=256, sliding_window=1024,
        rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=131072,
    ),
    # The whole Qwen3-0.6B (qwen3_bench.py's shape), for the FP8 variants' ratio on a small model.
    "qwen3-0.6b": dict(
        family="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
    # Granite-3.0-8B: Llama's layout with four multipliers (the residual one on both branches, logits / 16).
    "granite-3-8b-4l": dict(
        family="granite", hidden_size=4096, intermediate_size=12800, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=49155, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
        embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=16.0,
        max_position_embeddings=4096,
    ),
    # DeepSeek-V2-Lite's sizes (MLA with kv_lora_rank 512 and no query compression, rope part 64 of 192 per head;
    # first layer dense, then 64 routed experts top-6 and 2 shared) in transformers' DeepSeek-V3 architecture.
    "deepseek-v2-lite-4l": dict(
        family="deepseek_v3", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, vocab_size=102400, tie_word_embeddings=False, rope_interleave=False,
        max_position_embeddings=163840,
    ),
    "llama-3.1-8b-4l": dict(
        family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
}
MODELS["llama-3.1-8b"] = {**MODELS["llama-3.1-8b-4l"], "num_hidden_layers": 32}
# A smoke-test size: every code path of the real run in seconds on CPU (vocab divisible by the world size).
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=256)
# The same for the other families' extra sizes (experts, sliding window).
TINY_EXTRA = {"qwen3": {}, "qwen3_moe": dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2),
              "mixtral": dict(num_local_experts=4, num_experts_per_tok=2), "gemma3_text": dict(sliding_window=64),
              "llama": {}}
VARIANTS = ["eager", "hf_eager", "hf_grouped_mm", "liger", "kernelize", "compile", "kernelize_compile",
            "hf_grouped_mm_compile"]


def build(name: str, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, experts: str | None = None,
          tiny: bool = False, **overrides):
    """A randomly initialised model of one of :data:`MODELS`; ``experts`` sets ``experts_implementation``,
    ``tiny`` shrinks it to :data:`TINY` (with the family's :data:`TINY_EXTRA`)."""
    small = {**TINY, **TINY_EXTRA[MODELS[name]["family"]]} if tiny else {}
    spec = {**MODELS[name], **small, **overrides}
    family = spec.pop("family")
    return causal_lm(family, device=device, dtype=dtype, experts=experts, **spec)


def prepare(model, variant: str, modifiers: list[str], *, checkpointing: bool = False,
            compile_layers: bool = False) -> tuple[object, str]:
    for modifier in modifiers:
        if modifier.startswith("chunk"):
            set_loss_chunk_rows(modifier)
        elif modifier != "lm_head" or not variant.startswith("fp8_"):
            raise ValueError(f"unknown variant modifier {modifier!r}; expected chunk<N>, or lm_head on an fp8 variant")
    if checkpointing:
        # Before any variant's own preparation, so every variant recomputes the same decoder layers.
        enable_checkpointing(model)
    moe = any(hasattr(model.config, key) for key in ("num_experts", "num_local_experts"))
    how = f"experts_implementation={model.config._experts_implementation}" if moe else ""
    if variant == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    fp8 = variant.startswith("fp8_")
    if variant.startswith("kernelize") or fp8:
        import kernels_core

        mode = kernels_core.Mode.TRAINING
        if variant.endswith("compile") or fp8:
            mode |= kernels_core.Mode.TORCH_COMPILE
        config = fp8_linear_config(variant.removeprefix("fp8_"), lm_head="lm_head" in modifiers) if fp8 else None
        kernels_core.kernelize(model, mode=mode, config=config)
        how = "; ".join(filter(None, [how, kernels_core.get_report(model).summary()]))
    if variant.endswith("compile") or fp8:
        if compile_layers:
            # Each decoder layer compiled alone (torchtitan's recipe): one graph serves every layer, so a deep
            # model compiles in about one layer's time; the embedding, final norm and loss run eagerly.
            layers = model.model.layers
            for index, layer in enumerate(layers):
                layers[index] = torch.compile(layer)
            return model, how
        return torch.compile(model), how
    return model, how


def floor_key(row_name: str) -> str:
    """Which floor a row is measured against: ``bf16``, or its FP8 recipe (``+lm_head`` with an FP8 lm_head).

    Example:
        >>> floor_key("kernelize_compile@again"), floor_key("fp8_rowwise+lm_head+chunk4096")
        ('bf16', 'rowwise+lm_head')
    """
    base, *modifiers = row_name.split("@")[0].split("+")
    if not base.startswith("fp8_"):
        return "bf16"
    return base.removeprefix("fp8_") + ("+lm_head" if "lm_head" in modifiers else "")


def measure_floors(model_name: str, keys: list[str], *, tokens: tuple[int, int], device: str, tiny: bool,
                   checkpointing: bool, cache: pathlib.Path | None) -> dict[str, Any]:
    """The floor of each of ``keys`` (see :func:`floor_key`) for this model, timed on ``device``."""
    config = build(model_name, device="meta", tiny=tiny).config
    timer = floor.PartTimer(torch.device(device), cache=cache)
    floors = {}
    for key in keys:
        recipe, _, head = key.partition("+")
        floors[key] = floor.step_floor(config, batch=tokens[0], seq=tokens[1], timer=timer,
                                       fp8=None if recipe == "bf16" else recipe, lm_head_fp8=bool(head),
                                       checkpointing=checkpointing)
    return floors


def train(model_name: str, row_name: str, *, steps: int, warmup: int, tokens: tuple[int, int],
          profile: bool = False, device: str = "cuda", tiny: bool = False, checkpointing: bool = False,
          compile_layers: bool = False) -> dict:
    base, *modifiers = row_name.split("@")[0].split("+")
    experts = {"hf_eager": "eager", "hf_grouped_mm": "grouped_mm",
               "hf_grouped_mm_compile": "grouped_mm"}.get(base)
    model = build(model_name, experts=experts, device=device, tiny=tiny)
    model.train()
    start = time.perf_counter()
    runner, how = prepare(model, base, modifiers, checkpointing=checkpointing, compile_layers=compile_layers)
    kernelize_s = time.perf_counter() - start
    gen = torch.Generator(device=device).manual_seed(1)
    batch = torch.randint(0, model.config.vocab_size, tokens, device=device, generator=gen)
    # The first step on its own, then `warmup` more before the timed ones.
    timed, step = train_steps(runner, model.parameters(), batch, steps=steps, warmup=warmup + 1)
    result = {
        "tokens_per_s": round(steps * batch.numel() / timed["seconds"]),
        "step_ms": round(1e3 * timed["seconds"] / steps, 2),
        "peak_GiB": None if timed["peak_bytes"] is None else round(timed["peak_bytes"] / 2**30, 2),
        "first_step_s": round(timed["first_step_s"], 2),
        **({"kernelize_s": round(kernelize_s, 2)} if base.startswith(("kernelize", "fp8_")) else {}),
        # What a user waits for from the model's preparation to the end of the first step.
        "to_first_step_s": round(kernelize_s + timed["first_step_s"], 2),
        "losses": [round(v, 4) for v in timed["losses"]],
        "binding": how,
    }
    if base.endswith("compile") or base.startswith("fp8_"):
        from torch._dynamo.utils import counters

        result["dynamo_graph_breaks"] = sum(counters["graph_break"].values())
    if profile and device == "cuda":
        result["profile_one_step"] = profile_step(step)
        # Where the step's time beyond its floor goes, by kind of kernel (GEMMs, attention, the kernels, ...).
        result["profile_by_category_ms"] = profile_by_category(result["profile_one_step"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens", default="2x4096", help="batch x sequence length")
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--profile", action="store_true", help="add the GPU time per kernel of one more step")
    parser.add_argument("--rounds", type=int, default=1, help="run the variant list this many times, alternating")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="2-layer models of each shape (a smoke test)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing (non-reentrant) on the decoder layers, in every variant")
    parser.add_argument("--compile-layers", action="store_true",
                        help="compile variants compile each decoder layer alone instead of the whole model")
    parser.add_argument("--no-floor", action="store_true", help="no floor accounting (benchmarks.cuda.floor)")
    parser.add_argument("--floors", help=argparse.SUPPRESS)
    parser.add_argument("--floor-cache", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--settle", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = tuple(int(v) for v in args.tokens.split("x"))
    if args.child:
        model_name, variant = args.child.split(":")
        row = {"model": model_name, "variant": variant}
        try:
            if variant == "floor":
                row["floors"] = measure_floors(model_name, args.floors.split(","), tokens=tokens, device=args.device,
                                               tiny=args.tiny, checkpointing=args.checkpointing,
                                               cache=args.floor_cache)
            else:
                row.update(train(model_name, variant, steps=args.steps, warmup=args.warmup, tokens=tokens,
                                 profile=args.profile, device=args.device, tiny=args.tiny,
                                 checkpointing=args.checkpointing, compile_layers=args.compile_layers))
            if args.settle and args.device == "cuda":
                settle_cpp_extension()
        except Exception as exc:  # noqa: BLE001 - a failing variant is a result to report
            row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            row["traceback"] = traceback.format_exc()[-3000:]
        args.out.write_text(json.dumps(row))
        return
    models = args.models.split(",")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # the children write beside it

    def child(model_name: str, variant: str, *extra: str, steps: int = args.steps,
              env: dict[str, str] | None = None) -> dict:
        tmp = args.out.with_name(f".{model_name}-{variant}.json")
        common = ["--device", args.device, *(["--tiny"] if args.tiny else []),
                  *(["--checkpointing"] if args.checkpointing else []),
                  *(["--compile-layers"] if args.compile_layers else [])]
        cmd = python_m("benchmarks.cuda.models_bench", "--child", f"{model_name}:{variant}", "--out", str(tmp),
                       "--steps", str(steps), "--warmup", str(args.warmup), "--tokens", args.tokens, *common, *extra)
        start = time.perf_counter()
        result, error = run_child(cmd, tmp, timeout=args.timeout, env=env)
        row = result or {"model": model_name, "variant": variant}
        if error:
            row["process_error"] = error
        row["process_s"] = round(time.perf_counter() - start, 1)
        return row

    for model_name in models if args.device == "cuda" else ():
        settled = child(model_name, "kernelize", "--settle", steps=1)
        print(f"settling process, {model_name}: {settled.get('error') or settled.get('process_error') or 'done'}",
              flush=True)
    floors: dict[str, dict[str, Any]] = {}
    if not args.no_floor:
        keys = sorted({floor_key(parse_side(variant)[0]) for variant in args.variants.split(",")})
        with tempfile.TemporaryDirectory(prefix="floor-") as scratch:
            # One cache of part timings for the whole run: models sharing shapes time them once.
            cache = pathlib.Path(scratch) / "parts.json"
            for model_name in models:
                measured = child(model_name, "floor", "--floors", ",".join(keys), "--floor-cache", str(cache))
                floors[model_name] = measured.get("floors", {})
                print(f"floor, {model_name}: " + (measured.get("error") or measured.get("process_error") or ", ".join(
                    f"{key} {value.get('floor_ms')} ms" for key, value in floors[model_name].items())), flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for model_name in models:
            for variant in args.variants.split(","):
                row_name, env = parse_side(variant)
                with tempfile.TemporaryDirectory(prefix="triton-cold-") as empty:
                    if row_name.partition("@")[2].startswith("cold"):
                        env["TRITON_CACHE_DIR"] = empty
                    row = child(model_name, row_name, *(["--profile"] if args.profile else []), env=env)
                runs.setdefault((model_name, row_name), []).append(row)
                _write(args, runs, floors)  # after every row: a run cut short keeps what it measured
                print(json.dumps({k: v for k, v in row.items()
                                  if k not in ("traceback", "losses", "profile_one_step")}), flush=True)
    rows = _write(args, runs, floors)
    _ratios(rows, quiet=False)
    _chart(rows, args.out.with_suffix(".png"))


def _write(args: argparse.Namespace, runs: dict[tuple[str, str], list[dict]],
           floors: dict[str, dict[str, Any]]) -> list[dict]:
    """Write ``--out`` from the rows measured so far (medians over rounds, floors attached, ratios) and return them."""
    rows = [_median_row(rounds) for rounds in runs.values()]
    for row in rows:
        floor.attach(row, floors.get(row["model"], {}).get(floor_key(row["variant"])))
    _ratios(rows, quiet=True)
    write_json(args.out, {
        "environment": environment() if args.device == "cuda" else {"device": "cpu", "torch": torch.__version__},
        "config": f"bf16, sdpa, AdamW(fused), {args.tokens} tokens, {args.steps} timed steps after "
                  f"{args.warmup} warm-up steps and the first step"
                  + ("; activation checkpointing (non-reentrant) in every variant" if args.checkpointing else "")
                  + ("; compile variants: each decoder layer compiled alone" if args.compile_layers else "")
                  + ("; --tiny 2-layer models" if args.tiny else "")
                  + (f"; median of {args.rounds} alternating rounds" if args.rounds > 1 else ""),
        "rows": rows,
    })
    return rows


_MEASURES = ("tokens_per_s", "step_ms", "peak_GiB", "first_step_s", "kernelize_s", "to_first_step_s")


def _median_row(rounds: list[dict]) -> dict:
    """One row for a variant's rounds: the round of median throughput, with every measure's median and, over
    several rounds, each round's value."""
    done = [r for r in rounds if r.get("tokens_per_s")]
    if not done:
        return rounds[-1]
    row = dict(sorted(done, key=lambda r: r["tokens_per_s"])[len(done) // 2])
    if len(rounds) > 1:
        for key in _MEASURES:
            values = [r[key] for r in done if r.get(key) is not None]
            if values:
                row[key] = round(statistics.median(values), 2) if key != "tokens_per_s" else round(
                    statistics.median(values))
                row[f"{key}_rounds"] = values
        row["rounds"] = len(rounds)
    return row


def _ratios(rows: list[dict], *, quiet: bool) -> None:
    index = {(r["model"], r["variant"]): r for r in rows}
    for row in rows:
        if not row.get("tokens_per_s"):
            continue
        for base in ("eager", "compile", "kernelize_compile"):
            ref = index.get((row["model"], base))
            if ref and ref.get("tokens_per_s"):
                row[f"speed_vs_{base}"] = round(row["tokens_per_s"] / ref["tokens_per_s"], 3)
        eager = index.get((row["model"], "eager"), {})
        if eager.get("first_step_s"):
            row["first_step_vs_eager"] = round(row["first_step_s"] / eager["first_step_s"], 2)
            if row.get("to_first_step_s"):
                row["to_first_step_vs_eager"] = round(row["to_first_step_s"] / eager["to_first_step_s"], 2)
        if quiet:
            continue
        print(f"{row['model']:18s} {row['variant']:22s} {row['tokens_per_s']:8d} tok/s  "
              f"x{row.get('speed_vs_eager', 0):.2f} eager  x{row.get('speed_vs_compile', 0):.2f} compile  "
              f"peak {row['peak_GiB'] or 0:.1f} GiB  first step {row['first_step_s']:.1f} s  "
              f"floor {row.get('floor_ms', '-')} ms ({row.get('floor_fraction', '-')} of the step)", flush=True)


def _chart(rows: list[dict], path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4 * len(models)), squeeze=False)
    for axrow, model in zip(axes, models, strict=True):
        sub = [r for r in rows if r["model"] == model]
        names = [r["variant"] for r in sub]
        for ax, key, title in zip(axrow, ("tokens_per_s", "peak_GiB", "first_step_s"),
                                  ("tokens/s (higher better)", "peak GiB", "first step s"), strict=True):
            ax.bar(names, [r.get(key) or 0 for r in sub])
            ax.set_title(f"{model}: {title}")
            ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
