"""Would FP8 pay for MoE experts? torchao's FP8 rowwise grouped products against bf16 ones, at one layer.

The question behind an FP8 experts kernel: on the Qwen3-30B-A3B shape (hidden 2048, expert MLP 768, 128 experts,
8 per token), how much of an experts layer's forward + backward do FP8 grouped products save, once their own
costs are paid? torchao 0.17 ships FP8 training for grouped products only as a prototype
(``torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm``): per-row power-of-two scales, e4m3,
``torch._scaled_grouped_mm`` (SM90+), each expert's group of rows padded to a multiple of 16 by the caller, and
every call casts all experts' weights to FP8 (forward) and their transposes (backward).

Rows, each timed forward + backward with CUDA events (median of ``--repeats``) on the same routed rows:

- ``bf16_products``: the rows sorted by expert through ``gate_up_proj``, SiLU-gated, through ``down_proj``, as
  ``torch._grouped_mm`` (the products kernels-cuda's experts kernel runs);
- ``fp8_products``: the same with torchao's FP8 products, rows scattered into 16-aligned groups first and gathered
  back after (zeros in the padding, so the weight gradients are unchanged);
- ``fp8_weight_casts``: torchao's two weight quantizations alone (forward's per-expert column scales and the
  backward's transposed ones), what every FP8 call pays whatever its token count;
- with ``--compile``, ``bf16_products_compiled`` and ``fp8_products_compiled``: both chains under torch.compile;
- ``kernel_layer``: the whole experts layer as kernelize runs it (``kernels_triton.ops.moe_experts_silu``: routing,
  gather, products, activation, combine), for the share the products take.

Also: FP8's output and input-gradient error against bf16, relative to the largest bf16 magnitude.

    python -m benchmarks.cuda.experts_fp8_bench --tokens 8192,32768 --out /tmp/experts-fp8.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import environment
from benchmarks.common import write_json


QWEN3_30B_A3B = {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8}
ALIGN = 16


def route(tokens: int, experts: int, top_k: int, device: torch.device, *, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token from random router logits (softmax weights renormalised over the k chosen)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    weights, index = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return index, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


def group_ends(index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert (``perm``) and each expert's cumulative end (int32)."""
    sorted_ids, perm = torch.sort(index.reshape(-1), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(experts, device=index.device, dtype=sorted_ids.dtype),
                              right=True).to(torch.int32)
    return perm, ends


def aligned_layout(ends: torch.Tensor, rows: int, *, align: int = ALIGN) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each sorted row goes when every group starts at a multiple of ``align`` (``dest``), the padded
    groups' ends (the last group extended to the padded length) and that static length.

    Example:
        >>> dest, ends, length = aligned_layout(torch.tensor([3, 3, 20], dtype=torch.int32), 20)
        >>> dest[:4].tolist(), ends.tolist(), length
        ([0, 1, 2, 16], [16, 16, 80], 80)
    """
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + align - 1) // align * align
    padded_ends = torch.cumsum(padded, 0, dtype=torch.int32)
    length = -(-(rows + (align - 1) * ends.numel()) // align) * align  # an upper bound, known without a host read
    group = torch.searchsorted(ends, torch.arange(rows, device=ends.device, dtype=ends.dtype), right=True)
    dest = (padded_ends - padded)[group] + torch.arange(rows, device=ends.device) - (ends - sizes)[group]
    padded_ends = padded_ends.clone()
    padded_ends[-1] = length
    return dest, padded_ends, length


def bf16_products(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    gate_up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=ends)


def fp8_products(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_gmm

    dest, padded_ends, length = aligned_layout(ends, x.shape[0])
    # index_copy into zeros / index_select back: the padding rows are zero forward and get zero gradients.
    padded = x.new_zeros(length, x.shape[1]).index_copy(0, dest, x)
    gate_up = fp8_gmm(padded, w1.transpose(-2, -1), padded_ends, pad_token_groups_for_grouped_mm=False)
    gate, up = gate_up.chunk(2, dim=-1)
    out = fp8_gmm((F.silu(gate) * up).contiguous(), w2.transpose(-2, -1), padded_ends,
                  pad_token_groups_for_grouped_mm=False)
    return out.index_select(0, dest)


def weight_casts(w1: torch.Tensor, w2: torch.Tensor) -> None:
    """The weight-side work of torchao's FP8 products, as its autograd function does it each call."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale
    from torchao.float8.float8_utils import to_fp8_saturated
    from torchao.prototype.moe_training.kernels import triton_fp8_rowwise_3d_transpose_rhs

    for w in (w1, w2):
        b_t = w.transpose(-2, -1)
        scales = tensor_to_scale(b_t, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
                                 axiswise_dim=-2, round_scales_to_power_of_2=True)
        to_fp8_saturated(b_t.to(torch.float32) * scales, torch.float8_e4m3fn)
        triton_fp8_rowwise_3d_transpose_rhs(b_t, output_dtype=torch.float8_e4m3fn, round_scales_to_power_of_2=True)


def timed(fn, *, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after two warm-up calls (CUDA events)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(tokens: int, *, repeats: int, compiled: bool = False) -> dict:
    from kernels_triton.ops import moe_experts_silu

    device = torch.device("cuda")
    shape = QWEN3_30B_A3B
    hidden, inter, experts, top_k = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
    torch.manual_seed(0)
    w1 = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(experts, hidden, inter, device=device) * inter ** -0.5).to(torch.bfloat16).requires_grad_()
    states = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    index, weights = route(tokens, experts, top_k, device)
    perm, ends = group_ends(index, experts)
    rows = states.detach()[perm // top_k].requires_grad_()
    grad_rows = torch.randn(rows.shape[0], hidden, device=device, dtype=torch.bfloat16)
    grad_out = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)

    def step(products):
        def run() -> None:
            out = products(rows, w1, w2, ends)
            out.backward(grad_rows)
            for t in (rows, w1, w2):
                t.grad = None
        return run

    def layer() -> None:
        moe_experts_silu(states, index, weights, w1, w2).backward(grad_out)
        for t in (states, w1, w2):
            t.grad = None

    result = {"tokens": tokens, "rows": rows.shape[0], "shape": shape}
    result["ms"] = {
        "bf16_products": round(timed(step(bf16_products), repeats=repeats), 3),
        "fp8_products": round(timed(step(fp8_products), repeats=repeats), 3),
        "fp8_weight_casts": round(timed(lambda: weight_casts(w1.detach(), w2.detach()), repeats=repeats), 3),
        "kernel_layer": round(timed(layer, repeats=repeats), 3),
    }
    if compiled:
        # Both product chains under torch.compile, where Inductor fuses torchao's eager casts (as it does for the
        # FP8 linears, which kernels-cuda offers only under torch.compile).
        for name, products in (("bf16_products", bf16_products), ("fp8_products", fp8_products)):
            try:
                result["ms"][f"{name}_compiled"] = round(timed(step(torch.compile(products)), repeats=repeats), 3)
            except Exception as exc:  # noqa: BLE001 - a failing compile is a result to report
                result[f"{name}_compiled_error"] = f"{type(exc).__name__}: {exc}"[:500]
    ms = result["ms"]
    result["fp8_products_vs_bf16"] = round(ms["bf16_products"] / ms["fp8_products"], 3)
    result["layer_saving_if_fp8"] = round((ms["bf16_products"] - ms["fp8_products"]) / ms["kernel_layer"], 3)
    # Accuracy: FP8 against bf16 on the same rows, relative to bf16's largest magnitude.
    outs, grads = {}, {}
    for name, products in (("bf16", bf16_products), ("fp8", fp8_products)):
        out = products(rows, w1, w2, ends)
        out.backward(grad_rows)
        outs[name], grads[name] = out.detach().float(), rows.grad.detach().float()
        for t in (rows, w1, w2):
            t.grad = None
    result["fp8_output_error"] = round(float((outs["fp8"] - outs["bf16"]).abs().max() / outs["bf16"].abs().max()), 4)
    result["fp8_input_grad_error"] = round(
        float((grads["fp8"] - grads["bf16"]).abs().max() / grads["bf16"].abs().max()), 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768", help="comma-separated tokens per layer call")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also time both product chains under torch.compile")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = measure(tokens, repeats=args.repeats, compiled=args.compile)
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_json(args.out, {"environment": environment(), "what": __doc__.splitlines()[0], "rows": rows})


if __name__ == "__main__":
    main()
