"""transformers' Trainer on the Qwen3-0.6B shape (bf16, batch 4 x 2048, AdamW): plain, use_liger_kernel=True,
KernelizeCallback(), and each again with torch_compile=True, each variant in a fresh process (Liger patches
process-wide). Tokens/s from the Trainer's own metrics (train_tokens_per_second over the whole run) and over the
steps after warm-up (from step timestamps), peak GPU memory (per rank), the loss of every step.

    python benchmarks/cuda/trainer_bench.py --out benchmarks/results/trainer-qwen3-0.6b-h100.json [--steps 20]
    python benchmarks/cuda/trainer_bench.py --gpus 2 --variants plain,liger,kernelize \
        --out benchmarks/results/trainer-fsdp2-qwen3-0.6b-2xh200.json

``--gpus N`` (N > 1) runs each variant under ``torchrun`` on N GPUs with the Trainer's own FSDP2 (accelerate,
``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}``, one unit per decoder layer); batch 4 x 2048 per
rank, tokens/s over all ranks, the logged loss is the Trainer's mean over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time


VARIANTS = ["plain", "liger", "kernelize", "plain_compile", "liger_compile", "kernelize_compile"]
HERE = pathlib.Path(__file__).resolve().parent


def run_variant(variant: str, steps: int, warmup: int, output_dir: str, *, fsdp: bool = False) -> dict:
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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 151936, (seq,), generator=g)), "labels": ids}
            for _ in range(batch * steps * world)]
    if fsdp:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    model = build(device=f"cuda:{torch.cuda.current_device()}")
    wrapping = {}
    if fsdp:
        wrapping = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                                         "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]})
    args = TrainingArguments(**wrapping, output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps,
                             logging_steps=1, learning_rate=1e-5, optim="adamw_torch_fused", bf16=True,
                             report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                             include_num_input_tokens_seen=True,
                             use_liger_kernel=variant.startswith("liger"), torch_compile=variant.endswith("compile"))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    torch.cuda.reset_peak_memory_stats()
    output = trainer.train()
    tokens = batch * seq * world
    steady = (len(stamps) - warmup - 1) * tokens / (stamps[-1] - stamps[warmup])
    peaks = [torch.cuda.max_memory_allocated() / 2**30]
    if world > 1:
        import torch.distributed as dist

        peaks = [0.0] * world
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated() / 2**30)
    result = {
        "variant": variant,
        "world_size": world,
        "wrapper": type(trainer.model_wrapped).__name__,
        # The Trainer's own count of input tokens over its own train_runtime (whole run, warm-up included).
        "train_tokens_per_second": trainer.state.num_input_tokens_seen / output.metrics["train_runtime"],
        "steady_tokens_per_second": steady,
        "peak_memory_gib": max(peaks),
        "peak_memory_gib_per_rank": peaks,
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
    parser.add_argument("--gpus", type=int, default=1, help="GPUs; more than 1 runs the Trainer under FSDP2")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        result = run_variant(opts.one, opts.steps, opts.warmup, f"/tmp/trainer-bench/{opts.one}", fsdp=opts.gpus > 1)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result))
        return 0
    sys.path.insert(0, str(HERE))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _common import distributed_workers
    from _common import environment
    from _common import write_json

    if opts.gpus > 1:
        distributed_workers().set_distributed_env()  # NVLink multicast off, inherited by every torchrun below

    results = {}
    for variant in opts.variants.split(","):
        launcher = [sys.executable]
        if opts.gpus > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(opts.gpus)]
        proc = subprocess.run([*launcher, __file__, "--out", str(opts.out), "--steps", str(opts.steps),
                               "--warmup", str(opts.warmup), "--gpus", str(opts.gpus), "--one", variant],
                              capture_output=True, text=True)
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
    shape = "Qwen3-0.6B, bf16, batch 4 x 2048 per GPU, AdamW (fused)"
    if opts.gpus > 1:
        shape += f"; {opts.gpus} GPUs, the Trainer's FSDP2 (accelerate, fsdp_version 2, per decoder layer)"
    write_json(opts.out, {"environment": {**environment(), "world_size": opts.gpus}, "shape": shape,
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
    fig.suptitle(f"Trainer, Qwen3-0.6B shape, bf16, 4 x 2048 per GPU, {opts.gpus} GPU(s)")
    fig.tight_layout()
    fig.savefig(opts.out.with_suffix(".png"), dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
