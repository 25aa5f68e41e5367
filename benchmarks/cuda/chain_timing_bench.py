"""Where the time of a chain of kernelized RMSNorm layers goes, forward and backward, host against GPU.

``rmsnorm_bench.py`` reports what one more layer costs inside a training step (the 32-layer chain's time minus
the 8-layer chain's, per added layer). This script takes the same chains of kernelized ``Qwen3RMSNorm`` modules
(``Mode.TRAINING``) and times them several ways in one process, so the methods can be compared on one host:

* ``do_bench``: ``triton.testing.do_bench`` (L2 flushed before each call, median), as ``rmsnorm_bench.py``;
* ``events``: CUDA events around each call, no flush, median;
* ``host``: the wall time of the call itself (the forward's launches plus autograd's backward on its device
  thread, which ``torch.autograd.grad`` waits for; not the GPU's completion), GPU idle before each call, median;
* ``host_forward``: the same for the forward alone (the graph is recorded, then dropped);
* ``back_to_back``: the mean of many calls issued without synchronising in between.

Per added layer: (32-layer value - 8-layer value) / 24. Then one call of the 32-layer chain under the profiler
(CUDA activity only, so the host pays little for it): per phase, the kernels' summed GPU time and the idle time
between consecutive kernels, per layer. Idle GPU time inside a phase is time the host took longer than the GPU.

    python -m benchmarks.cuda.chain_timing_bench --shapes 8192x1024,16384x1024 --out /tmp/chain-timing.json
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import kernels_core
import torch

from benchmarks.common import bench
from benchmarks.common import environment
from benchmarks.common import kernelized_norms
from benchmarks.common import parse_shapes
from benchmarks.common import per_call_us
from benchmarks.common import write_json


LENGTHS = (8, 32)


def _median_us(fn, *, reps: int, sync_before: bool, events: bool) -> float:
    times = []
    for _ in range(reps):
        if sync_before:
            torch.cuda.synchronize()
        if events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e6)
    torch.cuda.synchronize()
    if events:
        times = [start.elapsed_time(end) * 1e3 for start, end in times]
    return statistics.median(times)


def _profile(fn, layers: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((event.time_range.start, event.time_range.end, event.name) for event in prof.events()
                     if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.end > 0)
    phases: dict[str, dict] = {}
    previous_end = None
    for start, end, name in kernels:
        phase = "forward" if "fwd" in name else "backward"
        entry = phases.setdefault(phase, {"kernels": 0, "busy_us": 0.0, "idle_us": 0.0})
        entry["kernels"] += 1
        entry["busy_us"] += end - start
        if previous_end is not None:
            entry["idle_us"] += max(0.0, start - previous_end)
        previous_end = end
    for entry in phases.values():
        entry["busy_per_layer_us"] = entry["busy_us"] / layers
        entry["idle_per_layer_us"] = entry["idle_us"] / layers
    return {"phases": phases, "kernel_names": sorted({name for _, _, name in kernels})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", default="8192x1024,16384x1024")
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    rows = []
    for n, h in parse_shapes(args.shapes):
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        timings: dict[str, dict[int, float]] = {}
        profiled = None
        for length in LENGTHS:
            chain = kernelized_norms(h, torch.bfloat16, mode=kernels_core.Mode.TRAINING, count=length)
            weights = [norm.weight for norm in chain]

            def step(chain=chain, weights=weights, x=x, dy=dy):
                torch.autograd.grad(chain(x), [x, *weights], dy)

            def forward(chain=chain, x=x):
                chain(x)

            for _ in range(5):
                step()
            measured = {
                "do_bench": bench(step),
                "events": _median_us(step, reps=args.reps, sync_before=False, events=True),
                "host": _median_us(step, reps=args.reps, sync_before=True, events=False),
                "host_forward": _median_us(forward, reps=args.reps, sync_before=True, events=False),
                "back_to_back": per_call_us(step, calls=args.reps, repeats=1),
            }
            for method, value in measured.items():
                timings.setdefault(method, {})[length] = value
            if length == LENGTHS[-1]:
                profiled = _profile(step, length)
        short, long = LENGTHS
        row = {"shape": [n, h], "per_added_layer_us": {
            method: (values[long] - values[short]) / (long - short) for method, values in timings.items()},
            "per_layer_8_us": {method: values[short] / short for method, values in timings.items()},
            "profile_32": profiled}
        rows.append(row)
        print(f"{n}x{h} per added layer: "
              + " ".join(f"{k} {v:6.1f}" for k, v in row["per_added_layer_us"].items())
              + " | 32-layer GPU per layer: "
              + " ".join(f"{phase} busy {p['busy_per_layer_us']:5.1f} idle {p['idle_per_layer_us']:5.1f}"
                         for phase, p in profiled["phases"].items()), flush=True)
    write_json(args.out, {"environment": environment(), "dtype": "bfloat16", "lengths": list(LENGTHS),
                          "reps": args.reps, "rows": rows})


if __name__ == "__main__":
    main()
