"""transformers' Trainer with ``KernelizeCallback`` under accelerate's FSDP2 (or DDP) on two GPUs.

    torchrun --standalone --nproc_per_node 2 trainer_worker.py --wrap fsdp     # 2 GPUs, NCCL

Two Trainers from the same seed on the same data, one after the other in the same job: the plain Trainer, then
the Trainer with ``KernelizeCallback()`` (kernels from every installed plugin). The Trainer wraps the model itself:
``fsdp="full_shard"`` with ``fsdp_config={"fsdp_version": 2, ...}`` makes accelerate apply ``fully_shard`` per
decoder layer, then to the root. Checks: the Trainer really wrapped (every parameter a DTensor under FSDP2, a
``DistributedDataParallel`` under DDP); the callback's report applied every expected kind on every module it
matched (RoPE included on CUDA) and names kernels-core's fused loss as the loss owner; the logged loss of every
step (the Trainer's mean over ranks) equals the plain Trainer's within the tolerance below.

GPU only: on CPU accelerate drops the FSDP plugin for ``use_cpu=True``; the CPU/gloo version of this check is
``core/tests/integrations/test_trainer_distributed.py``, which forces accelerate's FSDP path.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from _shared import DTYPES
from _shared import check
from _shared import check_report
from _shared import log
from _shared import rel
from _shared import set_distributed_env
from _shared import tiny_model


# Relative, per logged step. float32: the kernels differ from eager by summation order only (~1e-5 after 20
# AdamW steps); bfloat16: activations rounded at other points (the fused loss keeps float32 logits chunks).
TOLERANCES = {"float32": 1e-3, "bfloat16": 2e-2}


def training_args(args: argparse.Namespace, output_dir: str) -> Any:
    from transformers import TrainingArguments

    settings: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=2, max_steps=args.steps, logging_steps=1,
        learning_rate=1e-3, report_to=[], save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
        bf16=args.dtype == "bfloat16",
    )
    if args.wrap == "fsdp":
        settings.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                                          "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]})
    return TrainingArguments(**settings)


def train(kernelized: bool, args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    from kernels_core.integrations.transformers import KernelizeCallback
    from torch.distributed.tensor import DTensor
    from transformers import Trainer

    # Built in float32 on the CPU, as from_pretrained would; the Trainer moves it and bf16 autocast applies.
    model = tiny_model(args.layers, dtype=DTYPES["float32"])
    g = torch.Generator().manual_seed(7)
    data = [{"input_ids": (ids := torch.randint(3, 1024, (64,), generator=g)), "labels": ids}
            for _ in range(2 * args.steps * int(os.environ.get("WORLD_SIZE", "1")))]
    callback = KernelizeCallback() if kernelized else None
    trainer = Trainer(model=model, args=training_args(args, output_dir), train_dataset=data,
                      callbacks=[callback] if callback else [])
    trainer.train()
    return {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "wrapper": type(trainer.model_wrapped).__name__,
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "callback": callback,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wrap", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--device", choices=("cuda",), default="cuda",
                        help="GPU only (the CPU/gloo version is core/tests/integrations/test_trainer_distributed.py)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    # The Trainer (accelerate) creates the process group itself from torchrun's environment.
    set_distributed_env()
    with tempfile.TemporaryDirectory(prefix="kernels-trainer-") as out:
        plain = train(False, args, os.path.join(out, "plain"))
        kernel = train(True, args, os.path.join(out, "kernelized"))
    check(dist.is_initialized() and dist.get_world_size() == 2, "the Trainer did not run on two processes")
    what = f"Trainer {args.wrap} {args.dtype}"
    for run in (plain, kernel):
        if args.wrap == "fsdp":
            check(run["sharded"], f"{what}: parameters are not DTensors; accelerate did not apply FSDP2")
        else:
            check(run["wrapper"] == "DistributedDataParallel", f"{what}: wrapped in {run['wrapper']}, not DDP")
    callback = kernel["callback"]
    check_report(callback.report, "cuda", what=what)
    check("kernels-core's fused loss" in (callback.loss or ""), f"{what}: loss owner is {callback.loss!r}",
          callback.report)
    # Under FSDP2 the Trainer's AdamW steps on the local shards (the plain run's goes through DTensor dispatch);
    # under DDP nothing is sharded and the optimizer is left alone.
    local_step = (callback.optimizer_step or "").startswith("AdamW steps on local shards (")
    check(local_step == (args.wrap == "fsdp"), f"{what}: optimizer step {callback.optimizer_step!r}", callback.report)
    check(len(plain["losses"]) == len(kernel["losses"]) == args.steps,
          f"{what}: {len(plain['losses'])} / {len(kernel['losses'])} logged losses, expected {args.steps}")
    tolerance = TOLERANCES[args.dtype]
    worst = max(rel(k, p) for k, p in zip(kernel["losses"], plain["losses"], strict=True))
    log(f"{what}: losses plain {plain['losses']}\n{what}: losses kernelized {kernel['losses']}")
    check(worst <= tolerance, f"{what}: losses differ by {worst:.2e} relative (tolerance {tolerance})",
          callback.report)
    log(f"{what}: OK; worst relative loss difference {worst:.2e} over {args.steps} steps; "
        f"{callback.report.summary()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
