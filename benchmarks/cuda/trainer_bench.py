"""transformers' Trainer on the Qwen3-0.6B shape (bf16, batch 4 x 2048, AdamW): plain, use_liger_kernel=True,
KernelizeCallback(), and each again with torch_compile=True, each variant in a fresh process (Liger patches
process-wide). Tokens/s from the Trainer's own metrics (train_tokens_per_second over the whole run) and over the
steps after warm-up (from step timestamps), peak GPU memory (per rank), the loss of every step.

    python -m benchmarks.cuda.trainer_bench --out benchmarks/results/trainer-qwen3-0.6b-h100.json [--steps 20]
    python -m benchmarks.cuda.trainer_bench --gpus 2 --variants plain,liger,kernelize \
        --out benchmarks/results/trainer-fsdp2-qwen3-0.6b-2xh200.json

``--gpus N`` (N > 1) runs each variant under ``torchrun`` on N GPUs with the Trainer's own FSDP2 (accelerate,
``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}``, one unit per decoder layer); batch 4 x 2048 per
rank, tokens/s over all ranks, the logged loss is the Trainer's mean over ranks. ``--deepspeed 2`` or ``3`` runs
it under DeepSpeed ZeRO-2 / ZeRO-3 instead (``TrainingArguments(deepspeed=...)``, bf16, the Trainer's AdamW as
the client optimizer), on ``--gpus`` GPUs (1 included). ``kernelize_before`` calls ``kernels_core.kernelize`` on
the model before the Trainer exists (as LLaMA-Factory's ``KernelPlugin`` does at model load), ``kernelize`` adds
``KernelizeCallback()`` (which, under FSDP2, has the optimizer step on the local shards;
``kernelize_dtensor_step`` is the callback with ``local_shard_step=False``). ``--model`` takes a ``models_bench.py``
shape and ``--layers`` its depth (``--model llama-3.1-8b-4l --layers 32``: Llama-3.1-8B at full depth);
``--optimizer foreach`` uses torch's
multi-tensor AdamW instead of the fused one; ``--batch``/``--seq`` set the per-rank batch;
``--peft lora|lora_lm_head|qlora`` trains LoRA adapters (QLoRA: the base quantized to 4-bit nf4 by bitsandbytes
while loading). ``--packing`` sends each step's ``--batch`` documents of ``--seq`` tokens as one packed row through
``DataCollatorWithFlattening`` (restarting position ids, -100 at each document's start; the Trainer's default
``use_cache=False`` makes eager attend per document). ``--trl`` runs TRL's ``SFTTrainer`` instead, packing with
``SFTConfig(packing=True, padding_free=True)`` (best-fit decreasing) into rows of ``--batch`` x ``--seq`` tokens, one
row a step: the documents TRL users pack, with TRL's own loss and metrics. Kernelized variants wait for the norms'
C++ autograd nodes before training (steady-state numbers).

    python -m benchmarks.cuda.trainer_bench --gpus 4 --deepspeed 3 --variants plain,liger,kernelize,kernelize_before \
        --out benchmarks/results/trainer-zero3-qwen3-0.6b-4xh100.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from benchmarks.common import PEFT_TARGETS
from benchmarks.common import child_result
from benchmarks.common import distributed_workers
from benchmarks.common import environment
from benchmarks.common import pyplot
from benchmarks.common import python_m
from benchmarks.common import settle_cpp_extension
from benchmarks.common import with_lora
from benchmarks.common import write_json
from benchmarks.cuda.distributed_bench import build_model


VARIANTS = ["plain", "liger", "kernelize", "kernelize_before", "plain_compile", "liger_compile", "kernelize_compile",
            "kernelize_dtensor_step"]


def deepspeed_config(stage: int) -> dict:
    """ZeRO-``stage`` with the Trainer's own optimizer and bf16; "auto" values come from the TrainingArguments."""
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}}


def run_variant(variant: str, steps: int, warmup: int, output_dir: str, *, fsdp: bool = False,
                deepspeed: int | None = None, model_name: str = "qwen3-0.6b", layers: int | None = None,
                optimizer: str = "fused", batch: int = 4, seq: int = 2048, lora: str | None = None,
                packing: bool = False, trl: bool = False) -> dict:
    import torch
    from transformers import Trainer
    from transformers import TrainerCallback
    from transformers import TrainingArguments

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    callbacks: list = [Stamp()]
    if variant in ("kernelize", "kernelize_compile", "kernelize_dtensor_step"):
        from kernels_core.integrations.transformers import KernelizeCallback

        # kernelize_dtensor_step: the callback without its FSDP2 local-shard optimizer step (the A/B of that step).
        callbacks.append(KernelizeCallback(local_shard_step=False if variant == "kernelize_dtensor_step" else None))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    model = build_model(model_name, tiny=False, device=torch.device("cuda", torch.cuda.current_device()),
                        layers=layers)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, vocab, (seq,), generator=g)), "labels": ids}
            for _ in range(batch * steps * world)]
    collator = None
    if packing or trl:
        # The collator (TRL: its packing) builds the labels itself: the documents end to end, -100 at each one's
        # first token.
        data = [{"input_ids": example["input_ids"].tolist()} for example in data]
    if packing and not trl:
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening()
    if lora is not None:
        model = with_lora(model, lora, output_dir)
    if variant == "kernelize_before":
        import kernels_core

        kernels_core.kernelize(model, mode=kernels_core.Mode.TRAINING)
    if variant.startswith("kernelize"):
        # Steady-state numbers: the norms' C++ autograd nodes load in the background (seconds from the cache),
        # and the warm-up steps alone may not cover that; the callback variant kernelizes later than the others.
        settle_cpp_extension()
    wrapping: dict = {}
    if deepspeed is not None:
        wrapping = dict(deepspeed=deepspeed_config(deepspeed))
    elif fsdp:
        layer_cls = type(model.model.layers[0]).__name__
        wrapping = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                                         "transformer_layer_cls_to_wrap": [layer_cls]})
    common = dict(**wrapping, output_dir=output_dir, max_steps=steps, logging_steps=1, learning_rate=1e-5,
                  optim="adamw_torch_fused" if optimizer == "fused" else "adamw_torch", bf16=True, report_to=[],
                  save_strategy="no", seed=0, disable_tqdm=True, include_num_input_tokens_seen=True,
                  use_liger_kernel=variant.startswith("liger"), torch_compile=variant.endswith("compile"))
    if trl:
        trainer = trl_trainer(model, data, callbacks, common, row_tokens=batch * seq)
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**common, per_device_train_batch_size=batch),
                          train_dataset=data, callbacks=callbacks, data_collator=collator)
    head_adapter = {name: p.detach().clone() for name, p in model.named_parameters()
                    if "lm_head" in name and "lora_" in name}
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
        "trainer": type(trainer).__name__,
        "wrapper": type(trainer.model_wrapped).__name__,
        # The Trainer's own count of input tokens over its own train_runtime (whole run, warm-up included).
        "train_tokens_per_second": trainer.state.num_input_tokens_seen / output.metrics["train_runtime"],
        "steady_tokens_per_second": steady,
        "peak_memory_gib": max(peaks),
        "peak_memory_gib_per_rank": peaks,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }
    if trl:  # TRL logs its token accuracy from its own fused LM head
        result["mean_token_accuracy"] = [e.get("mean_token_accuracy") for e in trainer.state.log_history
                                         if "loss" in e]
    if head_adapter:
        # A LoRA adapter on lm_head must train through whatever computes the loss (a fused loss that reads the
        # frozen base weight alone leaves it as it was).
        now = dict(model.named_parameters())
        result["lm_head_adapter_trained"] = any(not torch.equal(now[name].detach(), before)
                                                for name, before in head_adapter.items() if name in now)
    if len(callbacks) > 1:
        result["kernelize"] = callbacks[1].report.summary()
        result["loss_owner"] = callbacks[1].loss
        result["optimizer_step"] = callbacks[1].optimizer_step
    elif variant == "kernelize_before":
        import kernels_core

        result["kernelize"] = kernels_core.get_report(model).summary()
    return result


def trl_trainer(model, data: list[dict], callbacks: list, common: dict, *, row_tokens: int):
    """TRL's SFTTrainer on pre-tokenized documents, packed (best-fit decreasing, padding-free) into one row of
    ``row_tokens`` a step, with the same training arguments as the Trainer's (``common``)."""
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig
    from trl import SFTTrainer

    # The documents are already token ids; the tokenizer only supplies pad/eos ids, which packing never inserts.
    backend = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1}, unk_token="<pad>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    args = SFTConfig(**common, per_device_train_batch_size=1, max_length=row_tokens, packing=True,
                     padding_free=True, dataset_num_proc=1)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(data), processing_class=tokenizer,
                      callbacks=callbacks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs; more than 1 runs the Trainer under FSDP2 unless --deepspeed is given")
    parser.add_argument("--deepspeed", type=int, choices=(2, 3), help="DeepSpeed ZeRO stage instead of FSDP2")
    parser.add_argument("--model", default="qwen3-0.6b", help="qwen3-0.6b or a models_bench.py shape")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's own)")
    parser.add_argument("--optimizer", choices=("fused", "foreach"), default="fused")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--peft", choices=sorted(PEFT_TARGETS),
                        help="train PEFT LoRA adapters (r 16) instead of all parameters: on every decoder linear, "
                             "on those and lm_head, or QLoRA (4-bit nf4 base, bitsandbytes)")
    parser.add_argument("--packing", action="store_true",
                        help="each step's documents packed in one row (DataCollatorWithFlattening)")
    parser.add_argument("--trl", action="store_true",
                        help="TRL's SFTTrainer, packing=True and padding_free=True, one row of batch x seq a step")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        result = run_variant(opts.one, opts.steps, opts.warmup, f"/tmp/trainer-bench/{opts.one}", fsdp=opts.gpus > 1,
                             deepspeed=opts.deepspeed, model_name=opts.model, layers=opts.layers,
                             optimizer=opts.optimizer, batch=opts.batch, seq=opts.seq, lora=opts.peft,
                             packing=opts.packing, trl=opts.trl)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result))
        return 0
    if opts.gpus > 1:
        distributed_workers().set_distributed_env()  # NVLink multicast off, inherited by every torchrun below

    results = {}
    passed = ["--out", str(opts.out), "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--gpus",
              str(opts.gpus), "--model", opts.model, "--optimizer", opts.optimizer, "--batch", str(opts.batch),
              "--seq", str(opts.seq)]
    passed += ["--deepspeed", str(opts.deepspeed)] if opts.deepspeed else []
    passed += ["--layers", str(opts.layers)] if opts.layers else []
    passed += ["--peft", opts.peft] if opts.peft else []
    passed += ["--packing"] if opts.packing else []
    passed += ["--trl"] if opts.trl else []
    for variant in opts.variants.split(","):
        torchrun = ["--standalone", "--nproc_per_node", str(opts.gpus)] if opts.gpus > 1 or opts.deepspeed else None
        cmd = python_m("benchmarks.cuda.trainer_bench", *passed, "--one", variant, torchrun=torchrun)
        results[variant] = r = child_result(cmd, variant)
        if "error" in r:
            continue
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
        "kernelize_vs_kernelize_dtensor_step_tokens": ratio("kernelize", "kernelize_dtensor_step"),
        "kernelize_vs_plain_memory": ratio("kernelize", "plain", "peak_memory_gib"),
        "kernelize_before_vs_plain_tokens": ratio("kernelize_before", "plain"),
        "kernelize_before_vs_liger_tokens": ratio("kernelize_before", "liger"),
        "kernelize_before_vs_plain_memory": ratio("kernelize_before", "plain", "peak_memory_gib"),
        "max_rel_loss_gap_kernelize_before_vs_plain": loss_gap("kernelize_before", "plain"),
        "max_rel_loss_gap_kernelize_vs_plain": loss_gap("kernelize", "plain"),
        "max_rel_loss_gap_kernelize_compile_vs_plain_compile": loss_gap("kernelize_compile", "plain_compile"),
        "max_rel_loss_gap_liger_vs_plain": loss_gap("liger", "plain"),
    }
    print(json.dumps(summary, indent=2))
    depth = f", {opts.layers} layers" if opts.layers else ""
    shape = f"{opts.model}{depth}, bf16, batch {opts.batch} x {opts.seq} per GPU, AdamW ({opts.optimizer})"
    if opts.trl:
        shape += f"; TRL SFTTrainer, packing + padding_free, {opts.batch} documents per row"
    elif opts.packing:
        shape += "; documents packed in one row (DataCollatorWithFlattening)"
    if opts.peft:
        shape += f"; PEFT {opts.peft} (r 16, dropout 0.05)"
    if opts.deepspeed:
        shape += f"; {opts.gpus} GPU(s), DeepSpeed ZeRO-{opts.deepspeed} through the Trainer"
    elif opts.gpus > 1:
        shape += f"; {opts.gpus} GPUs, the Trainer's FSDP2 (accelerate, fsdp_version 2, per decoder layer)"
    write_json(opts.out, {"environment": {**environment(), "world_size": opts.gpus}, "shape": shape,
                          "steps": opts.steps, "warmup_steps": opts.warmup, "summary": summary,
                          "results": results})
    plt = pyplot()
    if plt is None:
        return 0
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
    fig.suptitle(f"Trainer: {shape}", fontsize=9)
    fig.tight_layout()
    fig.savefig(opts.out.with_suffix(".png"), dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
