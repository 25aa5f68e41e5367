"""transformers' Trainer on the Qwen3-0.6B shape (bf16, batch 4 x 2048, AdamW): plain, use_liger_kernel=True,
KernelizeCallback(), and each again with torch_compile=True, each variant in a fresh process (Liger patches
process-wide). Tokens/s from the Trainer's own metrics (train_tokens_per_second over the whole run) and over the
steps after warm-up (from step timestamps), peak GPU memory, the loss of every step.

    python benchmarks/cuda/trainer_bench.py --out benchmarks/results/trainer-qwen3-0.6b-h100.json [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time


VARIANTS = ["plain", "liger", "kernelize", "plain_compile", "liger_compile", "kernelize_compile"]
HERE = pathlib.Path(__file__).resolve().parent


def run_variant(variant: str, steps: int, warmup: int, output_dir: str) -> dict:
    import torch
    from transformers import Trainer
    from transformers import TrainerCallback
    from transformers import TrainingArguments

    sys.path.insert(0, str(HERE))
    from qwen3_bench import build

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    callbacks: list = [Stamp()]
    if variant.startswith("kernelize"):
        from kernels_core.integrations.transformers import KernelizeCallback

        callbacks.append(KernelizeCallback())
    batch, seq = 4, 2048
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 151936, (seq,), generator=g)), "labels": ids}
            for _ in range(batch * steps)]
    model = build()
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps,
                             logging_steps=1, learning_rate=1e-5, optim="adamw_torch_fused", bf16=True,
                             report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                             include_num_input_tokens_seen=True,
                             use_liger_kernel=variant.startswith("liger"), torch_compile=variant.endswith("compile"))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    torch.cuda.reset_peak_memory_stats()
    output = trainer.train()
    tokens = batch * seq
    steady = (len(stamps) - warmup - 1) * tokens / (stamps[-1] - stamps[warmup])
    result = {
        "variant": variant,
        # The Trainer's own count of input tokens over its own train_runtime (whole run, warm-up included).
        "train_tokens_per_second": trainer.state.num_input_tokens_seen / output.metrics["train_runtime"],
        "steady_tokens_per_second": steady,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }
    if variant.startswith("kernelize"):
        result["kernelize"] = callbacks[1].report.summary()
        result["loss_owner"] = callbacks[1].loss
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        print("RESULT " + json.dumps(run_variant(opts.one, opts.steps, opts.warmup, f"/tmp/trainer-bench/{opts.one}")))
        return 0
    sys.path.insert(0, str(HERE))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _common import environment
    from _common import write_json

    results = {}
    for variant in opts.variants.split(","):
        proc = subprocess.run([sys.executable, __file__, "--out", str(opts.out), "--steps", str(opts.steps),
                               "--warmup", str(opts.warmup), "--one", variant], capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            results[variant] = {"variant": variant, "error": proc.stderr[-3000:]}
            print(f"{variant}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[variant] = json.loads(lines[-1].removeprefix("RESULT "))
        r = results[variant]
        print(f"{variant:18s} {r['steady_tokens_per_second']:9.0f} tok/s steady  {r['train_tokens_per_second']} "
              f"tok/s Trainer  {r['peak_memory_gib']:.2f} GiB  first/last loss {r['losses'][0]:.4f}/"
              f"{r['losses'][-1]:.4f}", flush=True)

    def ratio(a, b, key="steady_tokens_per_second"):
        ra, rb = results.get(a, {}), results.get(b, {})
        return ra[key] / rb[key] if key in ra and key in rb else None

    def loss_gap(a, b):
        la, lb = results.get(a, {}).get("losses"), results.get(b, {}).get("losses")
        return max(abs(x - y) / abs(y) for x, y in zip(la, lb, strict=True)) if la and lb else None

    summary = {
        "kernelize_vs_liger_tokens": ratio("kernelize", "liger"),
        "kernelize_vs_liger_memory": ratio("kernelize", "liger", "peak_memory_gib"),
        "kernelize_compile_vs_plain_compile_tokens": ratio("kernelize_compile", "plain_compile"),
        "kernelize_vs_plain_tokens": ratio("kernelize", "plain"),
        "max_rel_loss_gap_kernelize_vs_plain": loss_gap("kernelize", "plain"),
        "max_rel_loss_gap_kernelize_compile_vs_plain_compile": loss_gap("kernelize_compile", "plain_compile"),
        "max_rel_loss_gap_liger_vs_plain": loss_gap("liger", "plain"),
    }
    print(json.dumps(summary, indent=2))
    write_json(opts.out, {"environment": environment(), "shape": "Qwen3-0.6B, bf16, batch 4 x 2048, AdamW (fused)",
                          "steps": opts.steps, "warmup_steps": opts.warmup, "summary": summary,
                          "results": results})
    ok = [r for r in results.values() if "losses" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.bar([r["variant"] for r in ok], [r["steady_tokens_per_second"] for r in ok])
    left.set_ylabel("tokens/s (after warm-up)")
    left.tick_params(axis="x", rotation=30)
    for r in ok:
        right.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["variant"])
    right.set_xlabel("step")
    right.set_ylabel("loss")
    right.legend()
    fig.suptitle("Trainer, Qwen3-0.6B shape, bf16, 4 x 2048")
    fig.tight_layout()
    fig.savefig(opts.out.with_suffix(".png"), dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
