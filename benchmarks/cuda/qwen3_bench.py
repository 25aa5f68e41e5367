"""Qwen3-0.6B-shape training and prefill benchmark: eager, Liger's own patching, torch.compile, kernelize,
kernelize + torch.compile, each variant in a fresh process (Liger's patching is process-global).

    python -m benchmarks.cuda.qwen3_bench --out benchmarks/results/qwen3-h100.json

For tuning, a kernelize variant takes modifiers after ``+``: ``+native`` prefers the PyTorch-native kernels for
RMSNorm, RoPE and the gated MLP (``+native_norm``: for RMSNorm only; ``+native_residual``: for the fused residual
add + RMSNorm), ``+triton_norm`` takes the Triton kernels for both norm kinds at every size (the tuned kernels
pick by measured size thresholds), ``+python_autograd`` runs kernels-triton's norms through their Python
``autograd.Function`` instead of the C++ autograd extension, ``+no_residual`` disables the residual_rms_norm kind
(each norm on its own, as before it existed), ``+chunkN`` runs Liger's fused loss with token chunks of about N rows;
e.g. ``kernelize_compile+native+chunk128``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import traceback

import torch

from benchmarks.common import QWEN3_0_6B
from benchmarks.common import causal_lm
from benchmarks.common import environment
from benchmarks.common import profile_step
from benchmarks.common import pyplot
from benchmarks.common import python_m
from benchmarks.common import require_cuda_kernels
from benchmarks.common import run_child
from benchmarks.common import set_loss_chunk_rows
from benchmarks.common import settle_cpp_extension
from benchmarks.common import train_steps
from benchmarks.common import write_json


VARIANTS = [
    "eager",
    "liger",
    "torch_compile",
    "kernelize",
    "kernelize_compile",
    "liger_compile",
]


def build(seed: int = 0, device: str = "cuda", **overrides):
    """The Qwen3-0.6B shape (:data:`benchmarks.common.QWEN3_0_6B`; ``overrides`` for smoke-test sizes), bf16."""
    return causal_lm("qwen3", device=device, seed=seed, **{**QWEN3_0_6B, **overrides})


_NATIVE_KINDS = {"native": ("rms_norm", "rotary_embedding", "silu_gated_mlp"), "native_norm": ("rms_norm",),
                 "native_residual": ("residual_rms_norm",)}


def _kernelize_config(modifiers: list[str]) -> dict:
    kinds: dict = {}
    for modifier in modifiers:
        if modifier in _NATIVE_KINDS:
            for kind in _NATIVE_KINDS[modifier]:
                kinds[kind] = {"prefer": {"cuda": [f"cuda.{kind}.torch"]}}
        elif modifier == "triton_norm":
            for kind in ("rms_norm", "residual_rms_norm"):
                kinds[kind] = {"prefer": {"cuda": [f"cuda.{kind}.triton"]}}
        elif modifier == "python_autograd":
            # kernels-triton's norms with their Python autograd.Function instead of the C++ extension (A/B).
            os.environ["KERNELS_TRITON_CPP_AUTOGRAD"] = "0"
        elif modifier == "no_residual":
            kinds["residual_rms_norm"] = {"enabled": False}
        elif modifier.startswith("chunk"):
            set_loss_chunk_rows(modifier)
        else:
            raise ValueError(f"unknown variant modifier {modifier!r}; expected native, native_norm, "
                             "native_residual, triton_norm, python_autograd, no_residual or chunk<N>")
    return {"kinds": kinds}


def prepare(model, variant: str, *, training: bool) -> tuple[object, str]:
    how = ""
    variant, *modifiers = variant.split("+")
    if variant.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3(model=model)
    if variant.startswith("kernelize"):
        import kernels_core

        mode = kernels_core.Mode.TRAINING if training else kernels_core.Mode.INFERENCE
        if variant.endswith("compile"):
            mode |= kernels_core.Mode.TORCH_COMPILE
        kernels_core.kernelize(model, mode=mode, config=_kernelize_config(modifiers))
        # The norms' C++ autograd extension builds in the background on first use: time the steady state.
        how = f"C++ autograd extension: {settle_cpp_extension()}. "
        report = kernels_core.get_report(model)
        require_cuda_kernels(report)
        how += report.summary()
    if variant.endswith("compile"):
        return torch.compile(model), how
    return model, how


def train(variant: str, steps: int, warmup: int, *, profile: bool = False) -> dict:
    model = build()
    model.train()
    runner, how = prepare(model, variant, training=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch = torch.randint(0, 151936, (4, 2048), device="cuda", generator=gen)
    timed, step = train_steps(runner, model.parameters(), batch, steps=steps, warmup=warmup)
    result = {
        "train_tokens_per_s": steps * batch.numel() / timed["seconds"],
        "train_step_ms": 1e3 * timed["seconds"] / steps,
        "train_peak_GiB": timed["peak_bytes"] / 2**30,
        "losses": timed["losses"],
        "binding": how,
        "host_queue_ms_each": [round(1e3 * s, 2) for s in timed["host_queue_s"]],
    }
    if variant.split("+")[0].endswith("compile"):
        from torch._dynamo.utils import counters

        # A graph break splits the model into several compiled graphs, each resumed from Python: worth knowing.
        result["dynamo_graph_breaks"] = sum(counters["graph_break"].values())
        result["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"]
    if profile:
        result["profile_one_step"] = profile_step(step)
    torch.cuda.empty_cache()
    return result


def prefill(variant: str, reps: int) -> dict:
    torch._dynamo.reset()
    model = build()
    model.eval()
    runner, how = prepare(model, variant, training=False)
    ids = torch.randint(0, 151936, (1, 2048), device="cuda")
    with torch.no_grad():
        for _ in range(5):
            runner(input_ids=ids)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            runner(input_ids=ids)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    times.sort()
    return {"prefill_ms": times[len(times) // 2], "prefill_binding": how}


def child(variant: str, out: pathlib.Path, steps: int, *, profile: bool) -> None:
    result = {"variant": variant}
    try:
        result.update(train(variant, steps=steps, warmup=3, profile=profile))
    except Exception as exc:  # noqa: BLE001 - a crashing variant is a result to report
        result["train_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["train_traceback"] = traceback.format_exc()[-4000:]
    try:
        result.update(prefill(variant, reps=20))
    except Exception as exc:  # noqa: BLE001
        result["prefill_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--profile", action="store_true", help="also record GPU time per kernel of one train step")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.child_out, args.steps, profile=args.profile)
        return
    rows = []
    for variant in args.variants.split(","):
        tmp = args.out.with_name(f".{variant}.json")
        cmd = python_m("benchmarks.cuda.qwen3_bench", "--child", variant, "--child-out", str(tmp), "--steps",
                       str(args.steps))
        cmd += ["--profile"] if args.profile else []
        row, error = run_child(cmd, tmp, timeout=args.timeout)
        row = row or {"variant": variant}
        if error:
            row["process_error"] = error
        rows.append(row)
        hidden = ("losses", "train_traceback", "profile_one_step", "host_queue_ms_each")
        print(json.dumps({k: v for k, v in row.items() if k not in hidden}), flush=True)
        for kernel in row.get("profile_one_step", [])[:15]:
            print(f"    {kernel['gpu_ms']:9.3f} ms {kernel['calls']:6d}x  {kernel['kernel'][:90]}", flush=True)
    write_json(
        args.out,
        {
            "environment": environment(),
            "config": "Qwen3-0.6B shape, bf16, sdpa, AdamW(fused), train batch 4x2048, prefill 1x2048 no_grad",
            "steps_timed": args.steps,
            "rows": rows,
        },
    )
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r["variant"] for r in rows]
    for ax, key, title in zip(
        axes,
        ("train_tokens_per_s", "train_peak_GiB", "prefill_ms"),
        ("train tokens/s (higher better)", "train peak GiB", "prefill ms (lower better)"),
        strict=True,
    ):
        ax.bar(names, [r.get(key, 0) or 0 for r in rows])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(f"Qwen3-0.6B shape, {environment()['device']}")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
