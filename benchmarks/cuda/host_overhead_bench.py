"""Host time per call along the RMSNorm call path, layer by layer, forward and forward+backward, on a tiny input.

A memory-bound kernel on a mid-size tensor takes 5-20 us on the GPU; when the Python side of a call takes
longer, the GPU waits and that host time is what a module call costs. This script issues each stage of the path
back to back on an ``[8, 1024]`` bf16 input (GPU work negligible, so the loop is host-bound) and reports the
mean microseconds per call, side by side in one run:

* forward: ``torch.empty_like``, a bare launch of the compiled Triton kernel (Triton's own path and the direct
  one kernels-triton takes), the kernels-triton entry points (``ops.apply_rms_norm`` ->
  ``ops.rms_norm``), kernels-cuda's size-tuned entry point, the kernelized
  ``Qwen3RMSNorm`` module, and for reference ``F.rms_norm`` and the eager transformers module;
* forward with autograd recording (no backward): the Triton entry point with kernels-triton's C++ autograd node,
  the same with the Python ``autograd.Function``, the kernelized training module on the Triton kernel, and the
  extension's call alone;
* forward+backward through ``torch.autograd.grad``: ``F.rms_norm``, the Triton kernel (C++ and Python autograd
  nodes; bare and as the kernelized training module; the extension's call alone), a trivial Python
  ``autograd.Function`` (what any custom Function pays in the autograd engine), and the Triton backward called
  directly without autograd;
* chains of 8 layers (``chain_per_layer``; ``--chain-only`` runs just these): per layer, the forward with
  autograd recording and the forward+backward, for native ``clone`` and ``x * weight`` (PyTorch's own C++ nodes,
  the floor any autograd node pays on this host), ``F.rms_norm``, the Triton entry point, the extension's call
  alone and the kernelized training module (C++ and Python autograd nodes).

    python -m benchmarks.cuda.host_overhead_bench --out benchmarks/results/host-overhead-h100.json
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import threading
import time

import torch
import torch.nn.functional as F

from benchmarks.common import environment
from benchmarks.common import kernelized_norms
from benchmarks.common import per_call_us
from benchmarks.common import python_autograd_norms
from benchmarks.common import triton_norms
from benchmarks.common import write_json


class _Identity(torch.autograd.Function):
    """A Python Function doing nothing but a copy: what the autograd engine charges any custom Function."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy


def _identity_with_backward(extra) -> type[torch.autograd.Function]:
    """``_Identity`` whose backward also runs ``extra()``: isolates what one step costs in the engine's thread."""

    class _Probe(_Identity):
        @staticmethod
        def backward(ctx, dy):
            extra()
            return dy

    return _Probe


def chain_rows(rows: int, cols: int, *, cpp: tuple | None, profile: bool) -> dict:
    """Host microseconds per layer of a chain of ``CHAIN`` layers, each layer's output the next one's input, for
    several layer kinds side by side: the forward with autograd recording (graph built, then dropped) and the
    forward + backward through one ``torch.autograd.grad``, the backward's share being their difference. Native
    ``clone`` (a node with no backward work) and ``x * weight`` (one launch forward; backward two launches and a
    reduction, the shape of an RMSNorm backward) are what PyTorch's own C++ nodes cost on this host."""
    from kernels_core import Mode
    from kernels_triton import ops

    dtype = torch.bfloat16
    x = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    weights = [(1 + 0.1 * torch.randn(cols, device="cuda", dtype=dtype)).requires_grad_(True) for _ in range(CHAIN)]
    dy = torch.randn_like(x)
    modules = kernelized_norms(cols, dtype, mode=Mode.TRAINING, count=CHAIN)
    kinds = {
        "native_clone": lambda t, w: t.clone(),
        "native_mul_weight": lambda t, w: t * w,
        "f_rms_norm": lambda t, w: F.rms_norm(t, (cols,), w, 1e-6),
        "triton_kernels_rms_norm": lambda t, w: ops.apply_rms_norm(t, w, eps=1e-6, offset=0.0, gemma=False),
    }
    if cpp is not None:
        # The extension's call for this signature (the chain's weights have the same dtype as the probe's).
        function, call = cpp
        kinds["cpp_extension_call"] = lambda t, w: function(t, w, 1e-6, 0.0, call)

    def chain_of(layer):
        def run(t):
            for weight in weights:
                t = layer(t, weight)
            return t
        return run

    chains = {name: chain_of(layer) for name, layer in kinds.items()}
    chains["kernelized_module_triton"] = triton_norms(modules)
    chains["kernelized_module_triton_python_autograd"] = python_autograd_norms(triton_norms(modules))
    module_weights = [module.weight for module in modules]
    table: dict = {}
    for name, chain in chains.items():
        grads_of = [x, *(module_weights if name.startswith("kernelized") else weights)]

        def forward(chain=chain):
            chain(x)

        def forward_backward(chain=chain, grads_of=grads_of):
            torch.autograd.grad(chain(x), grads_of, dy, allow_unused=True)

        fwd = per_call_us(forward, calls=300) / CHAIN
        both = per_call_us(forward_backward, calls=300) / CHAIN
        table[name] = {"forward_with_grad": fwd, "forward_backward": both, "backward": both - fwd}
        print(f"chain {rows}x{cols} per layer {name:>42}: fwd {fwd:6.1f} fwd+bwd {both:6.1f} "
              f"bwd {both - fwd:6.1f} us", flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        run = chains["kernelized_module_triton"]
        with profiler(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                torch.autograd.grad(run(x), [x, *module_weights], dy)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    return table


CHAIN = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="print a profiler table of the Triton fwd+bwd")
    parser.add_argument("--chain-only", action="store_true", help="only the chains of layers (chain_per_layer)")
    args = parser.parse_args()

    import kernels_core
    from kernels_cuda import ops as cuda_ops
    from kernels_triton import ops

    # The norms' C++ autograd extension builds in the background on first use: wait, so the rows time it.
    ops.cpp_autograd_extension(wait=True)
    print("C++ autograd extension:", ops.cpp_autograd_status(), ops.cpp_autograd_failure() or "", flush=True)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    dtype = torch.bfloat16
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=dtype)
    w = torch.randn(args.cols, device="cuda", dtype=dtype)
    # The extension's call for this input signature, or None where the Python autograd path runs.
    cpp = ops.cpp_autograd_norm_call(x, w)
    if args.chain_only:
        write_json(args.out, {"environment": environment(), "input": {"shape": [args.rows, args.cols],
                                                                      "dtype": "bfloat16"},
                              "what": "mean host microseconds per layer, chains of layers back to back",
                              "cpp_autograd": ops.cpp_autograd_status(),
                              "results_us": {"chain_per_layer": chain_rows(args.rows, args.cols, cpp=cpp,
                                                                           profile=args.profile)}})
        return
    eager_module = Qwen3RMSNorm(args.cols, eps=1e-6).to("cuda", dtype)
    kernelized = kernels_core.kernelize(
        torch.nn.Sequential(Qwen3RMSNorm(args.cols, eps=1e-6).to("cuda", dtype)), mode=kernels_core.Mode.INFERENCE)
    report = kernels_core.get_report(kernelized)
    kernel_module = kernelized[0]

    y = torch.empty_like(x)
    block_m, block_n, num_warps = ops.norm_tiling(args.cols, x.element_size())
    grid = (args.rows + block_m - 1) // block_m
    launch_args = (x, w, y, y, args.rows, 1e-6, 0.0, args.cols, False, False, False, block_m, block_n)
    kernel = ops.rms_norm_forward_kernel
    compiled = kernel[(grid,)](*launch_args, num_warps=num_warps)  # compile and cache
    runner = compiled[(grid, 1, 1)]  # the compiled kernel, launched without Triton's argument binding

    def launch() -> None:
        kernel[(grid,)](*launch_args, num_warps=num_warps)

    forward = {
        "torch_empty_like": lambda: torch.empty_like(x),
        "triton_compiled_runner": lambda: runner(*launch_args),
        "triton_launch": launch,
        "triton_kernels_rms_norm": lambda: ops.apply_rms_norm(x, w, eps=1e-6, offset=0.0, gemma=False),
        "triton_adapter_rms_norm": lambda: ops.rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama"),
        "cuda_tuned_rms_norm": lambda: cuda_ops.rms_norm(x, w, eps=1e-6, offset=0.0, casting="llama"),
        "kernelized_module": lambda: kernel_module(x),
        "f_rms_norm": lambda: F.rms_norm(x, (args.cols,), w, 1e-6),
        "eager_module": lambda: eager_module(x),
    }
    results: dict = {"forward_no_grad": {}, "forward_backward": {}}
    with torch.no_grad():
        for name, fn in forward.items():
            results["forward_no_grad"][name] = per_call_us(fn)
            print(f"fwd  {name:>26}: {results['forward_no_grad'][name]:6.1f} us", flush=True)

    xg = x.detach().requires_grad_(True)
    wg = w.detach().requires_grad_(True)
    dy = torch.randn_like(x)
    _, saved_rstd = ops.rms_norm_forward(x, w, 1e-6, 0.0, False, store_rstd=True)

    def grad_of(fn, inputs):
        def run():
            torch.autograd.grad(fn(*inputs), inputs, dy)
        return run

    training = kernels_core.kernelize(
        torch.nn.Sequential(Qwen3RMSNorm(args.cols, eps=1e-6).to("cuda", dtype)), mode=kernels_core.Mode.TRAINING)
    training_module = training[0]

    with_grad = {
        "triton_kernels_rms_norm": lambda: ops.apply_rms_norm(xg, wg, eps=1e-6, offset=0.0, gemma=False),
        "triton_kernels_rms_norm_python_autograd": python_autograd_norms(
            lambda: ops.apply_rms_norm(xg, wg, eps=1e-6, offset=0.0, gemma=False)),
        "kernelized_module_triton": triton_norms(lambda: training_module(xg)),
    }
    if cpp is not None:
        function, call = cpp
        with_grad["cpp_extension_call"] = lambda: function(xg, wg, 1e-6, 0.0, call)
    results["forward_with_grad"] = {}
    for name, fn in with_grad.items():
        results["forward_with_grad"][name] = per_call_us(fn, calls=500)
        print(f"fwd with grad {name:>40}: {results['forward_with_grad'][name]:6.1f} us", flush=True)

    backward = {
        "f_rms_norm": grad_of(lambda a, b: F.rms_norm(a, (args.cols,), b, 1e-6), (xg, wg)),
        "triton_kernels_rms_norm": grad_of(
            lambda a, b: ops.apply_rms_norm(a, b, eps=1e-6, offset=0.0, gemma=False), (xg, wg)),
        "triton_kernels_rms_norm_python_autograd": python_autograd_norms(grad_of(
            lambda a, b: ops.apply_rms_norm(a, b, eps=1e-6, offset=0.0, gemma=False), (xg, wg))),
        "kernelized_module_triton": triton_norms(grad_of(lambda a: training_module(a), (xg,))),
        "kernelized_module_triton_python_autograd": python_autograd_norms(triton_norms(grad_of(
            lambda a: training_module(a), (xg,)))),
        "triton_forward_with_rstd_only": lambda: ops.rms_norm_forward(x, w, 1e-6, 0.0, False,
                                                                      store_rstd=True),
        "triton_backward_direct": lambda: ops.rms_norm_backward(dy, x, w, saved_rstd, 0.0, False,
                                                                want_dw=True),
        "python_function_identity": grad_of(_Identity.apply, (xg,)),
        "native_clone": grad_of(torch.clone, (xg,)),
        # The same identity Function whose backward (in the autograd engine's device thread) also runs one
        # piece of the Triton backward: where an in-engine cost comes from.
        "identity_bwd_plus_triton_launch": grad_of(
            _identity_with_backward(lambda: runner(*launch_args)).apply, (xg,)),
        "identity_bwd_plus_triton_launch_bound": grad_of(_identity_with_backward(launch).apply, (xg,)),
        "identity_bwd_plus_torch_allocs_and_sum": grad_of(
            _identity_with_backward(lambda: (torch.empty_like(x), torch.empty(64, args.cols, device="cuda")
                                             .sum(0).to(dtype))).apply, (xg,)),
        "identity_bwd_plus_current_device": grad_of(
            _identity_with_backward(torch.cuda.current_device).apply, (xg,)),
        "identity_bwd_plus_triton_backward": grad_of(
            _identity_with_backward(lambda: ops.rms_norm_backward(
                dy, x, w, saved_rstd, 0.0, False, want_dw=True)).apply, (xg,)),
    }
    for name, fn in backward.items():
        results["forward_backward"][name] = per_call_us(fn, calls=500)
        print(f"bwd  {name:>26}: {results['forward_backward'][name]:6.1f} us", flush=True)
    # The same piece of work timed from inside: wall and CPU time of the thread running it, in the main thread
    # and inside the autograd engine's device thread. Wall above CPU time means the thread waited (descheduled).
    pieces = {
        "triton_backward": lambda: ops.rms_norm_backward(dy, x, w, saved_rstd, 0.0, False, want_dw=True),
        "torch_allocs_and_sum": lambda: (torch.empty_like(x), torch.empty(64, args.cols, device="cuda")
                                         .sum(0).to(dtype)),
        "current_device": torch.cuda.current_device,
    }
    results["inside_thread_us"] = {}
    for name, piece in pieces.items():
        samples: list[tuple[float, float]] = []

        def timed(piece=piece, samples=samples):
            wall, cpu = time.perf_counter(), time.thread_time()
            piece()
            samples.append((time.perf_counter() - wall, time.thread_time() - cpu))

        for where, run in (("main", timed), ("engine", grad_of(_identity_with_backward(timed).apply, (xg,)))):
            samples.clear()
            per_call_us(run, calls=500)
            wall = sum(sample[0] for sample in samples) / len(samples) * 1e6
            cpu = sum(sample[1] for sample in samples) / len(samples) * 1e6
            results["inside_thread_us"][f"{name}_{where}"] = {"wall": wall, "thread_cpu": cpu}
            print(f"inside {name:>22} {where:>6}: wall {wall:6.1f} us, thread CPU {cpu:6.1f} us", flush=True)
    # Python threads alive (a thread waiting for the GIL would slow every GIL hand-over in the engine thread).
    results["python_threads"] = [thread.name for thread in threading.enumerate()]
    print("python threads:", results["python_threads"], flush=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    for name in ("triton_kernels_rms_norm", "identity_bwd_plus_triton_launch"):
        key = f"{name}_switchinterval_1us"
        results["forward_backward"][key] = per_call_us(backward[name], calls=500)
        print(f"bwd  {key:>26}: {results['forward_backward'][key]:6.1f} us", flush=True)
    sys.setswitchinterval(interval)
    if cpp is not None:
        results["forward_backward"]["cpp_extension_call"] = per_call_us(grad_of(
            lambda a, b: function(a, b, 1e-6, 0.0, call), (xg, wg)),
            calls=500)
        print(f"bwd  {'cpp_extension_call':>26}: {results['forward_backward']['cpp_extension_call']:6.1f} us",
              flush=True)
    results["chain_per_layer"] = chain_rows(args.rows, args.cols, cpp=cpp, profile=args.profile)
    if args.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile

        run = backward["triton_kernels_rms_norm"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30), flush=True)

    payload = {
        "environment": environment(),
        "input": {"shape": [args.rows, args.cols], "dtype": "bfloat16"},
        "what": "mean host microseconds per call, back to back, tiny input (host-bound)",
        "kernelized_module_kernel": [str(entry) for entry in getattr(report, "entries", [])][:1],
        "cpp_autograd": ops.cpp_autograd_status(),
        "results_us": results,
    }
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
