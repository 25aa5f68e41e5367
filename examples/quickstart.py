"""kernels-core quickstart: kernelize a Qwen3-shaped model and train it side by side with eager.

    pip install -e ./core && python examples/quickstart.py

No downloads: the model is built from a config with Qwen3's real 151,936-token vocabulary and a tiny body, so
a few training steps run on a laptop CPU. Each variant trains in a subprocess of its own so that its peak
memory is read from the operating system (CPU) or from torch's allocator (accelerators), never estimated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings


VARIANTS = ("eager", "kernelized")
SEED = 0
# Qwen3 layout (GQA, q/k norms, SwiGLU, tied embeddings) with the real vocabulary and a laptop-sized body.
CONFIG = dict(
    vocab_size=151_936,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
BATCH, SEQ_LEN = 4, 256


def quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")


def best_device() -> str:
    import torch

    if torch.cuda.is_available():  # CUDA and ROCm
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def build_model(device: str):
    import torch
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen3Config(**CONFIG, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).to(device).train()


def make_batch(step: int, device: str, *, batch: int = BATCH, seq_len: int = SEQ_LEN):
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq_len), generator=generator)
    labels = input_ids.clone()
    labels[:, : seq_len // 8] = -100  # a prompt whose tokens are not trained on, as in fine-tuning
    return {"input_ids": input_ids.to(device), "labels": labels.to(device)}


# --------------------------------------------------------------------------------------------- worker process


def _proc_status(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def _reset_peak(device: str) -> str:
    import torch

    module = getattr(torch, device, None)
    if device != "cpu" and hasattr(module, "reset_peak_memory_stats"):
        module.synchronize()
        module.reset_peak_memory_stats()
        return "allocator"
    try:  # Linux: restart the resident-set high-water mark so the peak covers the training steps only
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return "rss"
    except OSError:
        return "maxrss"


def _read_peak(device: str, method: str) -> int:
    import resource

    import torch

    if method == "allocator":
        module = getattr(torch, device)
        module.synchronize()
        return module.max_memory_allocated()
    if method == "rss":
        return _proc_status("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def worker(variant: str, device: str, steps: int, grads_path: str) -> None:
    quiet()
    import kernels_core
    import torch

    model = build_model(device)
    if variant == "kernelized":
        kernels_core.kernelize(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [make_batch(step, device) for step in range(steps)]
    losses, seconds = [], []
    baseline = _proc_status("VmRSS") if device == "cpu" else getattr(torch, device).memory_allocated()
    method = _reset_peak(device)
    for step, batch in enumerate(batches):
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        if step == 0:
            torch.save({n: p.grad.detach().cpu() for n, p in model.named_parameters()}, grads_path)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes, so the step time is complete
        seconds.append(time.perf_counter() - start)
    peak = _read_peak(device, method)
    print(json.dumps({"losses": losses, "seconds": seconds, "peak": peak, "baseline": baseline, "method": method}))


# --------------------------------------------------------------------------------------------- main process


def table(header: tuple[str, ...], rows: list[tuple[object, ...]]) -> str:
    cells = [tuple(str(c) for c in row) for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def run_variant(variant: str, device: str, steps: int, grads_path: str) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--device",
        device,
        "--steps",
        str(steps),
        "--grads",
        grads_path,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{variant} run failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def show_environment(device: str) -> None:
    import kernels_core
    import torch
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"kernels-core {kernels_core.__version__}; training on: {device}\n"
    )
    rows = [
        (b.backend, b.device_type, len(b.devices), ", ".join(d.name for d in b.devices) or "-")
        for b in kernels_core.detect_devices()
    ]
    print(table(("backend", "torch device", "count", "devices"), rows) + "\n")
    rows = [
        (p.name, p.distribution or "-", p.version or "-", p.status, p.reason or "")
        for p in kernels_core.list_plugins()
    ]
    print(table(("plugin", "distribution", "version", "status", "reason"), rows) + "\n")


def show_kernelize_and_unkernelize(device: str) -> bool:
    """Kernelize one model, print the report, then unkernelize it and check it is eager again, bit for bit."""
    import kernels_core
    import torch

    model = build_model(device)
    batch = make_batch(99, device, batch=1, seq_len=64)
    eager = model(**batch)
    kernels_core.kernelize(model)
    print(kernels_core.get_report(model).table() + "\n")
    fused = model(**batch)
    kernels_core.unkernelize(model)
    restored = model(**batch)
    same = torch.equal(restored.loss, eager.loss) and torch.equal(restored.logits, eager.logits)
    print(
        f"kernelized training forward: logits materialized: {fused.logits is not None}, "
        f"loss {fused.loss.item():.6f} vs eager {eager.loss.item():.6f}"
    )
    print(f"after unkernelize: logits and loss bit-identical to eager: {'yes' if same else 'NO'}\n")
    return same


def compare_gradients(paths: dict[str, str]) -> tuple[float, str]:
    import torch

    eager = torch.load(paths["eager"])
    kernelized = torch.load(paths["kernelized"])
    worst, worst_name = 0.0, ""
    for name, reference in eager.items():
        error = ((kernelized[name] - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()
        if error >= worst:
            worst, worst_name = error, name
    return worst, worst_name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default=None, help="default: the best device present")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--grads", help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet()
    if args.worker:
        worker(args.worker, args.device, args.steps, args.grads)
        return 0

    started = time.perf_counter()
    device = args.device or best_device()
    show_environment(device)
    restored_ok = show_kernelize_and_unkernelize(device)

    print(f"training {args.steps} AdamW steps, batch {BATCH} x {SEQ_LEN} tokens, same seed, one process each ...\n")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {v: os.path.join(tmp, f"{v}.pt") for v in VARIANTS}
        results = {v: run_variant(v, device, args.steps, paths[v]) for v in VARIANTS}
        grad_error, grad_worst = compare_gradients(paths)

    eager, kern = results["eager"], results["kernelized"]
    rows = []
    worst_loss = 0.0
    for step, (a, b) in enumerate(zip(eager["losses"], kern["losses"], strict=True), start=1):
        relative = abs(a - b) / abs(a)
        worst_loss = max(worst_loss, relative)
        rows.append((step, f"{a:.6f}", f"{b:.6f}", f"{relative:.1e}"))
    print(table(("step", "eager loss", "kernelized loss", "rel. diff"), rows) + "\n")

    def steady(seconds: list[float]) -> float:  # the first step pays one-off allocations and lazy imports
        rest = sorted(seconds[1:] or seconds)
        return rest[len(rest) // 2]

    what = {"allocator": "peak allocated", "rss": "peak RSS, training steps", "maxrss": "peak RSS, process"}
    label = what[eager["method"]]
    rows = [
        (v, f"{steady(r['seconds']) * 1000:,.0f} ms", mib(r["peak"]), mib(r["peak"] - r["baseline"]))
        for v, r in results.items()
    ]
    rows.append(
        (
            "kernelized / eager",
            f"{steady(kern['seconds']) / steady(eager['seconds']):.2f}x",
            f"{kern['peak'] / eager['peak']:.2f}x",
            f"{(kern['peak'] - kern['baseline']) / (eager['peak'] - eager['baseline']):.2f}x",
        )
    )
    print(table(("variant", "step time (median)", label, "above model + runtime"), rows) + "\n")
    print(f"first-step gradients: max relative difference {grad_error:.1e} ({grad_worst})")
    ok = worst_loss < 1e-5 and grad_error < 1e-4 and restored_ok
    print(
        f"losses agree to 1e-5: {'yes' if worst_loss < 1e-5 else 'NO'}; "
        f"total time {time.perf_counter() - started:.0f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
