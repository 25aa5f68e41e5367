"""Where a Qwen3-0.6B-shape training step spends GPU memory, per variant: eager, Liger's patching, kernelize, and
(with ``--variants``) the torch.compile variants of ``qwen3_bench.py``.

For one training step (after a warm-up step, so AdamW's states exist) it records the memory held before the
forward (parameters + optimizer states), the bytes autograd saves for backward grouped by the module class that
saved them (each storage counted once), and the peaks of the forward, the backward and the optimizer step.
Each variant runs in a fresh process (Liger's patching is process-global). A diagnostic, not a benchmark: it
explains the peak-memory column of ``qwen3_bench.py``. Every variant also groups the saved bytes by tensor shape
and dtype (parameters excluded); for compiled variants, whose saved tensors AOTAutograd decides out of reach of
saved-tensor hooks, that grouping reads the compiled graph's backward node instead, and no per-module split.
Finally it replays the caching allocator's trace of each phase and lists what, allocated in that phase, was live
at the phase's peak, grouped by the Python frames that allocated it.

    python -m benchmarks.cuda.memory_breakdown --out /tmp/memory.json
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib

import torch

from benchmarks.common import environment
from benchmarks.common import python_m
from benchmarks.common import run_child
from benchmarks.common import write_json
from benchmarks.cuda.qwen3_bench import build
from benchmarks.cuda.qwen3_bench import prepare


GIB = 2**30


def _frames(frames: list[dict], depth: int = 4) -> str:
    """The innermost Python frames of an allocation, skipping torch's own dispatch layers."""
    skip = ("torch/_ops.py", "torch/_library/", "torch/utils/_", "torch/_compile.py", "torch/_dynamo/eval_frame")
    kept = [f for f in frames if not any(part in f["filename"] for part in skip)]
    return " < ".join(f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']}:{f['name']}" for f in kept[:depth])


def _live_at_peak(snapshot: dict, *, top: int = 12) -> dict:
    """Replay the allocator trace of the recorded phase: what was allocated in it and still live at its peak."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        action, addr = event["action"], event["addr"]
        if action == "alloc":
            live[addr] = (event["size"], _frames(event.get("frames", [])))
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, where in best_live.values():
        groups[where][0] += size
        groups[where][1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
    return {"allocated_in_phase_at_peak_GiB": round(best / GIB, 4),
            "largest": [{"GiB": round(b / GIB, 4), "count": n, "where": w} for w, (b, n) in ranked]}


def _measure(variant: str) -> dict:
    model = build()
    model.train()
    runner, how = prepare(model, variant, training=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    batch = torch.randint(0, 151936, (4, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    runner(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    compiled = variant.split("+")[0].endswith("compile")
    stack: list[str] = ["<outside modules>"]
    handles = []

    # Hooks must return None: a forward hook's return value would replace the module's output.
    def enter(module, args):
        stack.append(type(module).__name__)

    def leave(module, args, output):
        stack.pop()

    for module in () if compiled else model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    saved: dict[str, int] = collections.Counter()
    by_shape: dict[str, int] = collections.Counter()
    seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.device.type == "cuda" and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[stack[-1]] += storage.nbytes()
            by_shape[f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"] += storage.nbytes()
        return t

    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    if compiled:
        loss = runner(input_ids=batch, labels=batch).loss
    else:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = runner(input_ids=batch, labels=batch).loss
    if compiled:
        node, pending = None, [loss.grad_fn]
        while pending and node is None:  # the compiled graph's backward node, a few steps up from the loss
            candidate = pending.pop()
            if candidate is not None and "Compiled" in type(candidate).__name__:
                node = candidate
            elif candidate is not None:
                pending.extend(next_fn for next_fn, _ in candidate.next_functions)
        for t in getattr(node, "saved_tensors", ()):
            if isinstance(t, torch.Tensor):
                pack(t)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    peak_forward = torch.cuda.max_memory_allocated()
    forward_trace = _live_at_peak(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    peak_backward = torch.cuda.max_memory_allocated()
    backward_trace = _live_at_peak(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak_optimizer = torch.cuda.max_memory_allocated()
    for handle in handles:
        handle.remove()
    return {
        "variant": variant,
        "binding": how,
        "params_and_optimizer_GiB": base / GIB,
        "held_after_forward_GiB": (after_forward - base) / GIB,
        "peak_forward_GiB": peak_forward / GIB,
        "peak_backward_GiB": peak_backward / GIB,
        "peak_optimizer_GiB": peak_optimizer / GIB,
        "saved_for_backward_GiB_by_module": {} if compiled else {k: round(v / GIB, 4) for k, v in saved.most_common()},
        "saved_for_backward_GiB_by_shape": {k: round(v / GIB, 4) for k, v in by_shape.most_common()},
        "forward_peak_allocations": forward_trace,
        "backward_peak_allocations": backward_trace,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--variants", default="eager,liger,kernelize")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.out.write_text(json.dumps(_measure(args.child)))
        return
    rows = []
    for variant in args.variants.split(","):
        tmp = args.out.with_name(f".mem-{variant}.json")
        row, error = run_child(python_m("benchmarks.cuda.memory_breakdown", "--out", str(tmp), "--child", variant),
                               tmp, timeout=300)
        if error or row is None:
            row = {"variant": variant, "error": error or "the process wrote no result"}
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    write_json(args.out, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
