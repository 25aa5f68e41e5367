"""Sweep the launch shape of kernels-triton's RMSNorm backward on the GPU, against a same-size copy, bf16.

The backward reads the saved input and the output gradient and writes the input gradient: three tensors of the
input's size, so its copy-bandwidth floor is 1.5 x a same-size copy. Each program walks a block of rows and
keeps one float32 weight-gradient row, summed afterwards by a second launch. The sweep varies the programs per
SM (``programs_per_sm``: more hides latency, but adds partial rows to write and sum), the tile each loop step
loads (``tile_bytes`` of input per tensor) and software pipelining of the loop (``stages``: 1 is none), and
reports each variant's GPU time alone (CUDA-graph replay, L2 flushed; :func:`_common.gpu_us`) with and without
the weight-gradient sum. It also times that sum both ways: kernels-triton's one launch and ``partial.sum(0)``
followed by the cast, and the forward kernel for reference.

    python benchmarks/cuda/rmsnorm_tiling_sweep.py --out benchmarks/results/cuda-rmsnorm-tiling-h200.json
"""

from __future__ import annotations

import argparse
import itertools
import pathlib

import torch
from _common import environment
from _common import gpu_us
from _common import write_json
from kernels_triton import _triton_kernels as kernels


SHAPES = [(8192, 1024), (16384, 1024), (131072, 128), (4096, 4096), (16384, 2048), (16384, 4096), (8192, 8192)]
PROGRAMS_PER_SM = (1, 2, 4, 8)
TILE_BYTES = (4096, 8192, 16384)
STAGES = (1, 2, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    dtype = torch.bfloat16
    device = torch.cuda.current_device()
    rows = []
    for n, h in SHAPES:
        x = torch.randn(n, h, device="cuda", dtype=dtype)
        w = torch.randn(h, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        dst = torch.empty_like(x)
        _, rstd = kernels.rms_norm_forward(x, w, 1e-6, 0.0, False, store_rstd=True)
        row: dict = {"shape": [n, h], "elements": n * h,
                     "copy_gpu_us": gpu_us(lambda dst=dst, x=x: dst.copy_(x)),
                     "forward_gpu_us": gpu_us(lambda x=x, w=w: kernels.rms_norm_forward(x, w, 1e-6, 0.0, False,
                                                                                       store_rstd=True))}
        default = kernels._norm_backward_tiling(n, h, x.element_size(), device)
        row["default_tiling"] = list(default)
        variants = []
        for per_sm, tile, stages in itertools.product(PROGRAMS_PER_SM, TILE_BYTES, STAGES):
            tiling = kernels._norm_backward_tiling(n, h, x.element_size(), device, programs_per_sm=per_sm,
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
        row["dw_sum_torch_gpu_us"] = gpu_us(lambda partial=partial: partial.sum(0).to(dtype))
        reference = partial.sum(0)
        row["dw_sum_max_abs_diff_vs_torch_float32"] = (out.float() - reference.to(dtype).float()).abs().max().item()
        rows.append(row)
        print(f"{n:>6}x{h:<5} copy {row['copy_gpu_us']:6.1f} fwd {row['forward_gpu_us']:6.1f} | bwd floor "
              f"{1.5 * row['copy_gpu_us']:6.1f}, default {default} -> "
              + next((f"{v['with_dw_gpu_us']:6.1f}" for v in timed if v["tiling"] == list(default)), "n/a")
              + f" | best {best['with_dw_gpu_us']:6.1f} ({best['with_dw_frac_copy_floor']:.0%}) at "
              f"{best['programs_per_sm']}/SM, {best['tile_bytes']} B, {best['stages']} stages | dw sum triton "
              f"{row['dw_sum_triton_gpu_us']:5.1f} torch {row['dw_sum_torch_gpu_us']:5.1f}", flush=True)
        for v in sorted(timed, key=lambda v: v["with_dw_gpu_us"])[:6]:
            print(f"    {v['programs_per_sm']}/SM {v['tile_bytes']:>5} B {v['stages']} st: "
                  f"dx {v['dx_only_gpu_us']:6.1f} with dw {v['with_dw_gpu_us']:6.1f}", flush=True)
    write_json(args.out, {"environment": environment(), "dtype": "bfloat16", "rows": rows})


if __name__ == "__main__":
    main()
