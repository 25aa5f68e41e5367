"""Sweep the launch shape of kernels-triton's RMSNorm backward on the GPU, against a same-size copy, bf16.

The backward reads the saved input and the output gradient and writes the input gradient: three tensors of the
input's size, so its copy-bandwidth floor is 1.5 x a same-size copy. Each program walks a block of rows and
keeps one float32 weight-gradient row, summed afterwards by a second launch. The sweep varies the programs per
SM (``programs_per_sm``: more hides latency, but adds partial rows to write and sum), the tile each loop step
loads (``tile_bytes`` of input per tensor) and software pipelining of the loop (``stages``: 1 is none), and
reports each variant's GPU time alone (CUDA-graph replay, L2 flushed; :func:`benchmarks.common.gpu_us`) with and
without the weight-gradient sum, and with the sum for the rstd recomputed in the kernel (what the eager autograd paths
do; ``with_dw_recomputed_gpu_us``) instead of read from the forward's saved rstd (the ``torch.compile`` ops). It
also times that sum both ways, kernels-triton's one launch (at its default and at each of ``SUM_TILINGS``) and
``partial.sum(0)`` followed by the cast, and the forward kernel for reference.

    python -m benchmarks.cuda.rmsnorm_tiling_sweep --out benchmarks/results/rmsnorm-tiling-h200.json
    python -m benchmarks.cuda.rmsnorm_tiling_sweep --shapes 131072x128 --programs-per-sm 2,4 --out /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import pathlib

import torch

from benchmarks.common import environment
from benchmarks.common import gpu_us
from benchmarks.common import parse_shapes
from benchmarks.common import write_json


SHAPES = [(8192, 1024), (16384, 1024), (131072, 128), (4096, 4096), (16384, 2048), (16384, 4096), (8192, 8192)]
PROGRAMS_PER_SM = (1, 2, 4, 8)
TILE_BYTES = (4096, 8192, 16384)
STAGES = (1, 2, 3)
# The weight-gradient sum's launch shapes: (rows, columns per step, pipeline stages, warps).
SUM_TILINGS = ((32, 32, 1, 4), (32, 32, 3, 4), (64, 16, 3, 4), (128, 16, 3, 4), (128, 8, 3, 4), (64, 32, 3, 4),
               (256, 8, 2, 8), (64, 8, 3, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", help="only these shapes, e.g. 8192x1024,131072x128 (default: all)")
    parser.add_argument("--programs-per-sm", default=",".join(map(str, PROGRAMS_PER_SM)),
                        help="comma-separated values to sweep (default: %(default)s)")
    parser.add_argument("--tile-bytes", default=",".join(map(str, TILE_BYTES)),
                        help="comma-separated values to sweep (default: %(default)s)")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)),
                        help="comma-separated values to sweep (default: %(default)s)")
    args = parser.parse_args()
    from kernels_triton import ops as kernels

    grid = [tuple(int(v) for v in values.split(",")) for values in (args.programs_per_sm, args.tile_bytes,
                                                                     args.stages)]
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    dtype = torch.bfloat16
    device = torch.cuda.current_device()
    rows = []
    for n, h in shapes:
        x = torch.randn(n, h, device="cuda", dtype=dtype)
        w = torch.randn(h, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        dst = torch.empty_like(x)
        _, rstd = kernels.rms_norm_forward(x, w, 1e-6, 0.0, False, store_rstd=True)
        row: dict = {"shape": [n, h], "elements": n * h,
                     "copy_gpu_us": gpu_us(lambda dst=dst, x=x: dst.copy_(x)),
                     "forward_gpu_us": gpu_us(lambda x=x, w=w: kernels.rms_norm_forward(x, w, 1e-6, 0.0, False,
                                                                                       store_rstd=True))}
        default = kernels.norm_backward_tiling(n, h, x.element_size(), device)
        row["default_tiling"] = list(default)
        variants = []
        for per_sm, tile, stages in itertools.product(*grid):
            tiling = kernels.norm_backward_tiling(n, h, x.element_size(), device, programs_per_sm=per_sm,
                                                   tile_bytes=tile, stages=stages)
            variant = {"programs_per_sm": per_sm, "tile_bytes": tile, "stages": stages, "tiling": list(tiling)}
            try:
                variant["dx_only_gpu_us"] = gpu_us(lambda tiling=tiling, x=x, w=w, dy=dy, rstd=rstd:
                                                   kernels.add_rms_norm_backward(dy, None, x, w, rstd, 0.0, False,
                                                                                 want_dw=False, tiling=tiling))
                variant["with_dw_gpu_us"] = gpu_us(lambda tiling=tiling, x=x, w=w, dy=dy, rstd=rstd:
                                                   kernels.add_rms_norm_backward(dy, None, x, w, rstd, 0.0, False,
                                                                                 want_dw=True, tiling=tiling))
                variant["with_dw_frac_copy_floor"] = 1.5 * row["copy_gpu_us"] / variant["with_dw_gpu_us"]
                variant["with_dw_recomputed_gpu_us"] = gpu_us(
                    lambda tiling=tiling, x=x, w=w, dy=dy: kernels.add_rms_norm_backward(
                        dy, None, x, w, None, 0.0, False, want_dw=True, eps=1e-6, tiling=tiling))
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile or fit is reported
                variant["error"] = f"{type(exc).__name__}: {exc}"[:300]
            variants.append(variant)
        row["variants"] = variants
        timed = [v for v in variants if "with_dw_gpu_us" in v]
        best = min(timed, key=lambda v: v["with_dw_gpu_us"])
        row["best"] = {k: best[k] for k in ("programs_per_sm", "tile_bytes", "stages", "with_dw_gpu_us",
                                            "with_dw_frac_copy_floor")}
        # The weight-gradient sum, both ways, on the default tiling's partial rows.
        programs = default[3]
        partial = torch.randn(programs, h, device="cuda", dtype=torch.float32)
        out = torch.empty(h, device="cuda", dtype=dtype)
        row["dw_sum_triton_gpu_us"] = gpu_us(lambda partial=partial, out=out: kernels.sum_partial_rows(partial, out))
        row["dw_sum_tilings"] = [
            {"tiling": list(tiling), "gpu_us": gpu_us(lambda partial=partial, out=out, tiling=tiling:
                                                      kernels.sum_partial_rows(partial, out, tiling=tiling))}
            for tiling in SUM_TILINGS]
        row["dw_sum_torch_gpu_us"] = gpu_us(lambda partial=partial: partial.sum(0).to(dtype))
        reference = partial.sum(0)
        row["dw_sum_max_abs_diff_vs_torch_float32"] = (out.float() - reference.to(dtype).float()).abs().max().item()
        rows.append(row)
        print(f"{n:>6}x{h:<5} copy {row['copy_gpu_us']:6.1f} fwd {row['forward_gpu_us']:6.1f} | bwd floor "
              f"{1.5 * row['copy_gpu_us']:6.1f}, default {default} -> "
              + next((f"{v['with_dw_gpu_us']:6.1f}" for v in timed if v["tiling"] == list(default)), "n/a")
              + f" | best {best['with_dw_gpu_us']:6.1f} ({best['with_dw_frac_copy_floor']:.0%}) at "
              f"{best['programs_per_sm']}/SM, {best['tile_bytes']} B, {best['stages']} stages | dw sum triton "
              f"{row['dw_sum_triton_gpu_us']:5.1f} torch {row['dw_sum_torch_gpu_us']:5.1f} | sum tilings "
              + " ".join(f"{tuple(t['tiling'])}: {t['gpu_us']:.1f}" for t in row["dw_sum_tilings"]), flush=True)
        for v in sorted(timed, key=lambda v: v["with_dw_gpu_us"])[:6]:
            print(f"    {v['programs_per_sm']}/SM {v['tile_bytes']:>5} B {v['stages']} st: "
                  f"dx {v['dx_only_gpu_us']:6.1f} with dw {v['with_dw_gpu_us']:6.1f} "
                  f"(rstd recomputed {v['with_dw_recomputed_gpu_us']:6.1f})", flush=True)
    write_json(args.out, {"environment": environment(), "dtype": "bfloat16", "rows": rows})


if __name__ == "__main__":
    main()
