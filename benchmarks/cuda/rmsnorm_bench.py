"""RMSNorm microbenchmark: Liger vs torch.nn.functional.rms_norm vs kernels-triton's Triton kernel vs the tuned
kernel kernels-cuda picks, against the measured device-to-device copy bandwidth, forward and forward+backward, bf16.

Two timings per kernel: ``*_us`` are medians of ``triton.testing.do_bench`` (L2 flushed between calls), so a
kernel whose host-side work outlasts its GPU time shows that cost, with the host's jitter; ``*_gpu_us`` (forward
only) replay CUDA graphs, which remove host work and measure the kernel itself: that is the number the
copy-bandwidth target is judged on, against a same-size copy timed the same way. ``host_us`` is the other view:
the mean time per call of 200 calls issued back to back on a tiny input, which is what a launch-bound model
(prefill) pays per layer.

The module call path: ``module_fwd_us`` times a transformers ``Qwen3RMSNorm`` kernelized by kernels-core
(``Mode.INFERENCE``, called under ``no_grad``), so the module call, the core's forward and the size-tuned choice
are all counted. ``chain_*`` runs stacks of 8 and of 32 such modules (``Mode.TRAINING``; ``module_triton``: the same
modules with the size thresholds at zero, so every call takes the Triton kernel; or the bare functions) forward
and backward in one ``torch.autograd.grad``. ``chain_*_per_layer_us`` is the difference of the two divided by
24: what one more layer costs inside a step, every host cost on its path included (module call, the core's
forward, the size choice, the autograd node, launches), while the step's fixed costs (the ``autograd.grad`` entry,
the wake-ups of autograd's device thread, the L2 flush before each timed call) cancel. It is the median over
``--rounds`` rounds, each timing every variant's two chains back to back (``*_rounds``: every round's value;
``*_range``: the fraction of a copy in the slowest and the fastest round). ``chain8_*`` is the 8-layer stack's
time per layer with those fixed costs shared by 8 layers. Each layer moves five tensors of the
input's size (forward: read, write; backward: read input and gradient, write gradient), so its fraction of a
same-size copy (two tensors) is ``2.5 * copy_us / per-layer us``. ``module_triton_python_autograd`` is
``module_triton`` with kernels-triton's C++ autograd extension switched off (the Python ``autograd.Function``
path), side by side in the same run. ``chain_*_gpu_per_layer_us`` replays the 32-layer chain as a CUDA graph: the
GPU time alone, against which the gap to the chain as called is the host's share.

    python -m benchmarks.cuda.rmsnorm_bench --out benchmarks/results/rmsnorm-h100.json
    python -m benchmarks.cuda.rmsnorm_bench --chain-only --shapes 8192x1024,16384x1024 --out /tmp/chains.json
"""

from __future__ import annotations

import argparse
import pathlib
import time

import kernels_core
import torch
import torch.nn.functional as F

from benchmarks.common import bench
from benchmarks.common import environment
from benchmarks.common import gpu_us
from benchmarks.common import kernelized_norms
from benchmarks.common import parse_shapes
from benchmarks.common import pyplot
from benchmarks.common import python_autograd_norms
from benchmarks.common import triton_norms
from benchmarks.common import write_json


SHAPES = [
    (256, 1024),
    (1024, 1024),
    (2048, 1024),
    (4096, 1024),
    (8192, 1024),
    (16384, 1024),
    (131072, 128),
    (4096, 4096),
    (16384, 2048),
    (8192, 8192),
    (16384, 4096),
    (32768, 4096),
    (65536, 2048),
    (32768, 8192),
]


CHAIN = 8
LONG_CHAIN = 32


def _apply_all(t: torch.Tensor, weights: list[torch.Tensor], norm) -> torch.Tensor:
    for weight in weights:
        t = norm(t, weight)
    return t


CHAIN_NAMES = ("module", "f_rms_norm", "triton", "module_triton", "module_triton_python_autograd")


def _chains(chain_module: torch.nn.Sequential) -> dict:
    """The chain variants over one stack of kernelized modules (see the module docstring)."""
    from kernels_triton import ops

    weights = [norm.weight for norm in chain_module]
    return {
        "module": chain_module,
        "f_rms_norm": lambda t: _apply_all(t, weights, lambda t, weight: F.rms_norm(t, (t.shape[-1],), weight, 1e-6)),
        "triton": lambda t: _apply_all(
            t, weights, lambda t, weight: ops.rms_norm(t, weight, eps=1e-6, offset=0.0, casting="llama")),
        # The kernelized modules with the size thresholds set to pick the Triton kernel at every size.
        "module_triton": triton_norms(chain_module),
        # The same, with the norms' autograd nodes in Python instead of kernels-triton's C++ extension.
        "module_triton_python_autograd": python_autograd_norms(triton_norms(chain_module)),
    }


def chain_rows(row: dict, x: torch.Tensor, *, rounds: int) -> None:
    """Adds the ``chain_*`` entries of one shape to ``row`` (see the module docstring).

    Each round times every variant's 8- and 32-layer chains back to back, so a slow spell of the host shows in
    one round's figures rather than in one variant's: the reported per-layer cost is the median over rounds,
    with the rounds' minimum and maximum beside it. The CUDA-graph replays come after all eager timings (a
    capture changes the caching allocator's state).
    """
    hidden = x.shape[-1]
    xg = x.detach().requires_grad_(True)
    dy = torch.randn_like(x)
    steps = {}
    for length in (CHAIN, LONG_CHAIN):
        chain_module = kernelized_norms(hidden, x.dtype, mode=kernels_core.Mode.TRAINING, count=length)
        weights = [norm.weight for norm in chain_module]
        for name, chain in _chains(chain_module).items():

            def chain_fwd_bwd(chain=chain, weights=weights):
                torch.autograd.grad(chain(xg), [xg, *weights], dy)

            steps[length, name] = chain_fwd_bwd
    totals: dict[tuple[int, str], list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            totals[key].append(bench(step))
    for name in CHAIN_NAMES:
        # What one more layer costs inside a step: the step's fixed costs (the autograd.grad entry and the
        # wake-ups of the engine's thread, the flush before each timed call) cancel in the difference.
        marginals = sorted((long - short) / (LONG_CHAIN - CHAIN)
                           for short, long in zip(totals[CHAIN, name], totals[LONG_CHAIN, name], strict=True))
        marginal = marginals[len(marginals) // 2]
        row[f"chain_{name}_per_layer_us"] = marginal
        row[f"chain_{name}_per_layer_us_rounds"] = marginals
        row[f"chain_{name}_frac_same_size_copy"] = 2.5 * row["copy_us"] / marginal
        row[f"chain_{name}_frac_same_size_copy_range"] = [2.5 * row["copy_us"] / marginals[-1],
                                                          2.5 * row["copy_us"] / marginals[0]]
        # The short chain's time per layer, the step's fixed costs shared by 8 layers.
        short = sorted(totals[CHAIN, name])[len(totals[CHAIN, name]) // 2]
        row[f"chain{CHAIN}_{name}_per_layer_us"] = short / CHAIN
        row[f"chain{CHAIN}_{name}_frac_same_size_copy"] = 2.5 * row["copy_us"] * CHAIN / short
    for name in CHAIN_NAMES:
        # The long chain replayed as a CUDA graph: its GPU time alone, so the gap to the rows above is what the
        # host (module calls, autograd nodes, launches) adds.
        try:
            row[f"chain_{name}_gpu_per_layer_us"] = gpu_us(steps[LONG_CHAIN, name], calls=2) / LONG_CHAIN
            row[f"chain_{name}_gpu_frac_same_size_copy"] = (
                2.5 * row["copy_gpu_us"] / row[f"chain_{name}_gpu_per_layer_us"])
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            row[f"chain_{name}_gpu_error"] = f"{type(exc).__name__}: {exc}"[:300]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", help="only these shapes, e.g. 8192x1024,16384x1024 (default: the full sweep)")
    parser.add_argument("--chain-only", action="store_true",
                        help="only the copy timings and the chains of layers (no single-call rows, no chart)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of chain timings; per-layer costs are their median (default: 5)")
    args = parser.parse_args()
    from kernels_cuda import ops as cuda_ops
    from kernels_triton import ops

    dtype = torch.bfloat16
    # The norms' C++ autograd extension builds in the background on first use: wait, so every row times it.
    cpp_autograd = ops.cpp_autograd_extension(wait=True) is not None
    print("C++ autograd extension:", ops.cpp_autograd_status(), ops.cpp_autograd_failure() or "", flush=True)
    # Copy bandwidth: bytes read + written by a large device-to-device copy.
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(big)
    copy_bw = 2 * big.numel() / (bench(lambda: dst.copy_(big)) * 1e-6) / 1e9
    big = dst = None  # free before the sweep
    kernels = {
        "liger": lambda x, w: ops.liger_rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama"),
        "f_rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "triton": lambda x, w: ops.rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama"),
        "tuned": lambda x, w: cuda_ops.rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama"),
    }
    host = {}
    tiny_x = torch.randn(8, 1024, device="cuda", dtype=dtype)
    tiny_w = torch.randn(1024, device="cuda", dtype=dtype)
    for name, fn in kernels.items():
        for _ in range(20):
            fn(tiny_x, tiny_w)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            fn(tiny_x, tiny_w)
        host[name] = (time.perf_counter() - start) / 200 * 1e6
        torch.cuda.synchronize()
    print("host us per call:", {k: round(v, 1) for k, v in host.items()}, flush=True)
    rows = []
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    for n, h in shapes:
        x = torch.randn(n, h, device="cuda", dtype=dtype)
        w = torch.randn(h, device="cuda", dtype=dtype)
        dst = torch.empty_like(x)
        row = {"shape": [n, h], "elements": n * h, "copy_us": bench(lambda dst=dst, x=x: dst.copy_(x)),
               "copy_gpu_us": gpu_us(lambda dst=dst, x=x: dst.copy_(x))}
        if not args.chain_only:
            nbytes = 2 * x.numel() * x.element_size()
            for name, fn in kernels.items():
                row[f"{name}_fwd_us"] = bench(lambda fn=fn, x=x, w=w: fn(x, w))
                row[f"{name}_fwd_frac_copy_bw"] = nbytes / (row[f"{name}_fwd_us"] * 1e-6) / 1e9 / copy_bw
                # Against a copy of the same tensor (same bytes, same launch and tail effects): the target.
                row[f"{name}_fwd_frac_same_size_copy"] = row["copy_us"] / row[f"{name}_fwd_us"]
                try:
                    row[f"{name}_fwd_gpu_us"] = gpu_us(lambda fn=fn, x=x, w=w: fn(x, w))
                    row[f"{name}_fwd_gpu_frac_same_size_copy"] = row["copy_gpu_us"] / row[f"{name}_fwd_gpu_us"]
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured in a graph is reported
                    row[f"{name}_fwd_gpu_error"] = f"{type(exc).__name__}: {exc}"[:300]
                xg = x.detach().requires_grad_(True)
                wg = w.detach().requires_grad_(True)
                dy = torch.randn_like(x)

                def fwd_bwd(fn=fn, xg=xg, wg=wg, dy=dy):
                    y = fn(xg, wg)
                    torch.autograd.grad(y, (xg, wg), dy)

                row[f"{name}_fwdbwd_us"] = bench(fwd_bwd)
            module = kernelized_norms(h, dtype, mode=kernels_core.Mode.INFERENCE, count=1)[0]
            with torch.no_grad():
                row["module_fwd_us"] = bench(lambda module=module, x=x: module(x))
            row["module_fwd_frac_same_size_copy"] = row["copy_us"] / row["module_fwd_us"]
            row["module_fwd_frac_copy_bw"] = nbytes / (row["module_fwd_us"] * 1e-6) / 1e9 / copy_bw
        chain_rows(row, x, rounds=args.rounds)
        rows.append(row)
        line = f"{n:>6}x{h:<5} copy {row['copy_us']:7.1f}us"
        if not args.chain_only:
            line += (
                f" | fwd liger {row['liger_fwd_us']:7.1f} F {row['f_rms_norm_fwd_us']:7.1f} "
                f"triton {row['triton_fwd_us']:7.1f} tuned {row['tuned_fwd_us']:7.1f} "
                f"({row['tuned_fwd_frac_same_size_copy']:.0%} of copy) | fwd+bwd liger {row['liger_fwdbwd_us']:7.1f} "
                f"F {row['f_rms_norm_fwdbwd_us']:7.1f} triton {row['triton_fwdbwd_us']:7.1f} "
                f"tuned {row['tuned_fwdbwd_us']:7.1f} | GPU-only fwd: copy {row['copy_gpu_us']:6.1f} "
                + " ".join(f"{k} {row.get(k + '_fwd_gpu_us', float('nan')):6.1f}" for k in kernels)
                + f" (tuned {row.get('tuned_fwd_gpu_frac_same_size_copy', float('nan')):.0%} of copy)"
                + f" | module fwd {row['module_fwd_us']:6.1f} ({row['module_fwd_frac_same_size_copy']:.0%} of copy)")
        line += " | chain per layer fwd+bwd " + " ".join(
            f"{k} {row[f'chain_{k}_per_layer_us']:6.1f} ({row[f'chain_{k}_frac_same_size_copy']:.0%}, rounds "
            f"{row[f'chain_{k}_frac_same_size_copy_range'][0]:.0%}-{row[f'chain_{k}_frac_same_size_copy_range'][1]:.0%}"
            f", GPU {row.get(f'chain_{k}_gpu_per_layer_us', float('nan')):6.1f})"
            for k in CHAIN_NAMES)
        print(line, flush=True)
    payload = {
        "environment": environment(),
        "dtype": "bfloat16",
        "copy_bandwidth_GBps": copy_bw,
        "tuned_triton_min_elements": cuda_ops.rms_norm_thresholds().min_elements,
        "tuned_triton_min_elements_with_grad": cuda_ops.rms_norm_thresholds().min_elements_with_grad,
        "cpp_autograd": cpp_autograd,
        "chain_rounds": args.rounds,
        "host_us_per_call": host,
        "rows": rows,
    }
    write_json(args.out, payload)
    plt = pyplot()
    if args.chain_only or plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['shape'][0]}x{r['shape'][1]}" for r in rows]
    for ax, phase in zip(axes, ("fwd", "fwdbwd"), strict=True):
        for name in kernels:
            ax.plot(labels, [r[f"{name}_{phase}_us"] for r in rows], marker="o", label=name)
        if phase == "fwd":
            ax.plot(labels, [r["copy_us"] for r in rows], linestyle="--", color="gray", label="copy")
        ax.set_yscale("log")
        ax.set_title(f"RMSNorm {phase} bf16, {payload['environment']['device']}")
        ax.set_ylabel("median us")
        ax.tick_params(axis="x", rotation=60)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)

if __name__ == "__main__":
    main()
