"""RoPE and gated-activation microbenchmark at Qwen3-0.6B shapes: eager ATen math vs Liger vs kernels-triton's
Triton kernels, forward (no grad) and forward+backward, bf16, side by side in one run.

    python -m benchmarks.cuda.elementwise_bench --out /tmp/elementwise.json

Shapes: training batch 4 x 2048 tokens and prefill 1 x 2048 (q: 16 heads, k: 8 heads, head_dim 128, taken as the
[B, S, H, D] projection viewed as [B, H, S, D]; MLP intermediate 3072). Medians of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from benchmarks.common import bench
from benchmarks.common import environment
from benchmarks.common import write_json


def _fwd_bwd(fn, inputs):
    leaves = [t.detach().requires_grad_(True) for t in inputs]

    def run():
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    from kernels_triton import ops

    dtype = torch.bfloat16
    rope = {"eager": ops.native_rotary_embedding, "liger": ops.liger_rotary_embedding,
            "triton": ops.rotary_embedding}
    gated = {"eager": ops.native_silu_mul, "liger": ops.liger_silu_mul, "triton": ops.silu_mul}
    rows = []
    for batch in (1, 4):
        seq = 2048
        q = torch.randn(batch, seq, 16, 128, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.randn(batch, seq, 8, 128, device="cuda", dtype=dtype).transpose(1, 2)
        theta = torch.randn(1, seq, 64, device="cuda").repeat(1, 1, 2)
        cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
        gate = torch.randn(batch * seq, 3072, device="cuda", dtype=dtype)
        up = torch.randn_like(gate)
        for what, table, inputs, extra in (("rope", rope, (q, k), (cos, sin)), ("silu_mul", gated, (gate, up), ())):
            row = {"op": what, "tokens": batch * seq}
            for name, fn in table.items():

                def call(*tensors, fn=fn, extra=extra):
                    return fn(*tensors, *extra)

                row[f"{name}_fwd_us"] = bench(lambda call=call, inputs=inputs: call(*inputs))
                row[f"{name}_fwdbwd_us"] = bench(_fwd_bwd(call, inputs))
            rows.append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    write_json(args.out, {"environment": environment(), "dtype": "bfloat16", "rows": rows})


if __name__ == "__main__":
    main()
