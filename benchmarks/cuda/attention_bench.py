"""Causal attention backends side by side at the Qwen3-0.6B training and prefill shapes.

Each row times ``F.scaled_dot_product_attention`` pinned to one backend (cuDNN, FlashAttention-2; the
memory-efficient kernel ran at a quarter of cuDNN's speed on an H200 and is left out), plus FlexAttention compiled
with a causal block mask, forward and forward+backward, and reports the ratio to the default dispatch and the
achieved TFLOP/s. Inputs come in two layouts: ``bhsd`` (contiguous per head) and ``bshd``
(the transposed views transformers' attention modules pass, ``proj(x).view(B, S, H, D).transpose(1, 2)``, with the
output gradient in the same layout), and through transformers' own ``sdpa_attention_forward``, eager and compiled.
Outputs are checked against the math backend in float32 first, so a fast but wrong backend shows as an error
rather than a win.

    python -m benchmarks.cuda.attention_bench --out benchmarks/results/attention-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel

from benchmarks.common import bench
from benchmarks.common import environment
from benchmarks.common import write_json


SHAPES = {  # (batch, query heads, key/value heads, sequence, head dim)
    "train 4x2048": (4, 16, 8, 2048, 128),
    "prefill 1x2048": (1, 16, 8, 2048, 128),
    "long 1x8192": (1, 16, 8, 8192, 128),
}
BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
}


def _causal_flops(batch: int, heads: int, seq: int, dim: int) -> float:
    # Two matmuls of 2*S*S*D each per head, half of them masked away.
    return 4 * batch * heads * seq * seq * dim / 2


def _sdpa(backend: SDPBackend | None, *, gqa: bool):
    def run(q, k, v):
        if not gqa and k.shape[1] != q.shape[1]:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v):
        key = (q.shape[2], k.shape[2])
        if key not in masks:
            masks[key] = create_block_mask(causal, None, None, q.shape[2], k.shape[2], device=q.device)
        return compiled(q, k, v, block_mask=masks[key], enable_gqa=True)

    return run


def _varlen():
    """Every row as one document of a packed batch, through kernels-cuda's packed_attention kernel (torch's
    FlashAttention varlen): what a packed row of equal documents costs against the same rows unpacked."""
    from kernels_triton.ops import native_varlen_attention

    def run(q, k, v):
        batch, heads, seq, dim = q.shape
        cu = torch.arange(0, (batch + 1) * seq, seq, device=q.device, dtype=torch.int32)
        flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (q, k, v)]
        out = native_varlen_attention(*flat, cu_seqlens=cu, max_seqlen=seq, scale=dim ** -0.5, window=None)
        return out.view(batch, seq, heads, dim).transpose(1, 2)

    return run


def _transformers(*, compiled: bool):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class _Module(torch.nn.Module):
        is_causal = True

        def __init__(self, groups: int) -> None:
            super().__init__()
            self.num_key_value_groups = groups

    def run(q, k, v):
        return sdpa_attention_forward(_Module(q.shape[1] // k.shape[1]), q, k, v, None, scaling=q.shape[-1] ** -0.5
                                      )[0].transpose(1, 2)

    return torch.compile(run, dynamic=False) if compiled else run


def _inputs(layout: str, batch: int, heads: int, kv_heads: int, seq: int, dim: int):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make(h):
        dense = torch.randn(batch, h, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        # Same values in both layouts, so one float32 reference checks every variant.
        return dense.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bshd" else dense

    return make(heads), make(kv_heads), make(kv_heads), make(heads)


def measure(name: str, shape: tuple[int, int, int, int, int], variants: dict) -> list[dict]:
    batch, heads, kv_heads, seq, dim = shape
    q, k, v, grad = _inputs("bhsd", *shape)
    with sdpa_kernel([SDPBackend.MATH]):
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        ref.backward(grad.float())
    ref_grads = [t.grad for t in leaves]
    flops = _causal_flops(batch, heads, seq, dim)
    rows = []
    layouts = {layout: _inputs(layout, *shape) for layout in ("bhsd", "bshd")}
    for label, (layout, fn) in variants.items():
        row = {"shape": name, "variant": label, "layout": layout}
        q, k, v, grad = layouts[layout]
        try:
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            out = fn(qq, kk, vv)
            out.backward(grad)
            row["max_abs_err_out"] = (out.float() - ref).abs().max().item()
            row["max_abs_err_grads"] = max((t.grad.float() - r).abs().max().item()
                                           for t, r in zip((qq, kk, vv), ref_grads, strict=True))

            def fwd(fn=fn, inputs=(q, k, v)):
                with torch.no_grad():
                    fn(*inputs)

            def fwd_bwd(fn=fn, leaves=(qq, kk, vv), grad=grad):
                fn(*leaves).backward(grad)

            row["fwd_us"] = bench(fwd, rep=100)
            row["fwd_bwd_us"] = bench(fwd_bwd, rep=100)
            row["fwd_tflops"] = flops / row["fwd_us"] / 1e6
            row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_us"] / 1e6  # backward does 2.5x the forward's math
        except Exception as exc:  # noqa: BLE001 - an unsupported backend is a result
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(row, flush=True)
    base = next((r for r in rows if r["variant"] == "default gqa bhsd" and "fwd_us" in r), None)
    for row in rows:
        if base and "fwd_us" in row:
            row["fwd_speedup_vs_default"] = base["fwd_us"] / row["fwd_us"]
            row["fwd_bwd_speedup_vs_default"] = base["fwd_bwd_us"] / row["fwd_bwd_us"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles for a minute)")
    args = parser.parse_args()
    variants = {}
    for layout in ("bhsd", "bshd"):
        for label, backend in BACKENDS.items():
            variants[f"{label} gqa {layout}"] = (layout, _sdpa(backend, gqa=True))
            variants[f"{label} repeat_kv {layout}"] = (layout, _sdpa(backend, gqa=False))
        variants[f"varlen packed {layout}"] = (layout, _varlen())
        variants[f"transformers sdpa {layout}"] = (layout, _transformers(compiled=False))
        variants[f"transformers sdpa compiled {layout}"] = (layout, _transformers(compiled=True))
        if not args.no_flex:
            variants[f"flex gqa {layout}"] = (layout, _flex())
    rows = [row for name, shape in SHAPES.items() for row in measure(name, shape, variants)]
    write_json(args.out, {"environment": environment(), "note": "bf16, causal; errors vs the float32 math backend",
                          "rows": rows})


if __name__ == "__main__":
    main()
