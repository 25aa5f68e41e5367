"""transformers' Trainer under DeepSpeed ZeRO-2 / ZeRO-3 (``TrainingArguments(deepspeed=...)``) with kernels-core.

    python deepspeed_worker.py --stage 3                                    # one GPU (RANK etc. set here)
    torchrun --standalone --nproc_per_node 2 deepspeed_worker.py --stage 3  # two GPUs, NCCL

Trainers from the same seed on the same data, one after the other in the same job:

- ``plain``: the model loaded after the arguments (under ZeRO-3 inside ``deepspeed.zero.Init``: partitioned);
- ``callback``: the same with ``KernelizeCallback()``, which kernelizes at the end of ``Trainer.__init__``, before
  DeepSpeed's engine exists (under ZeRO-3 on the partitioned parameters);
- ``late``: the callback added after the Trainer was built; it kernelizes in ``on_train_begin``, after the engine;
- ``plain-before`` / ``before``: the model built before the arguments (whole parameters, no ``zero.Init``), plain,
  and kernelized (``kernels_core.kernelize``) before the Trainer exists.

Checks: DeepSpeed really wraps (``DeepSpeedEngine``; under ZeRO-3 every parameter partitioned); each kernelized
report applied the fused loss, the residual add + norm, RMSNorm and the gated MLP (RoPE too where a plugin has it)
and names kernels-core's fused loss as the loss owner; every logged loss equals its plain run's within the
tolerance below. Prints tokens/s (over all steps, the first included) and peak memory per run (rank 0's GPU).
``--shape qwen3-0.6b`` trains the published Qwen3-0.6B configuration (random weights) instead of the tiny one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from _shared import DTYPES
from _shared import TINY
from _shared import check
from _shared import check_report
from _shared import log
from _shared import rel
from _shared import set_distributed_env


# Relative, per logged step: the kernels differ from eager by summation order (float32); bfloat16 rounds the
# activations at other points (the fused loss keeps float32 logit chunks).
TOLERANCES = {"float32": 1e-3, "bfloat16": 2e-2}
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2)
SHAPES = {"tiny": (TINY, 2, 256, 2), "qwen3-0.6b": (QWEN3_06B, 28, 2048, 4)}  # config, layers, tokens, batch
RUNS = ("plain", "callback", "late", "plain-before", "before")
REFERENCE = {"callback": "plain", "late": "plain", "before": "plain-before"}


def deepspeed_config(stage: int, threshold: int | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3 and threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True}


def model(args: argparse.Namespace) -> Any:
    """A seeded Qwen3ForCausalLM of ``args.shape``; norm weights perturbed so a kernel misreading them shows."""
    from transformers import AutoModelForCausalLM
    from transformers import Qwen3Config

    config, layers, _, _ = SHAPES[args.shape]
    torch.manual_seed(0)
    # from_config, as from_pretrained, builds the model inside deepspeed.zero.Init once ZeRO-3 arguments exist.
    built = AutoModelForCausalLM.from_config(Qwen3Config(**config, num_hidden_layers=args.layers or layers,
                                                         attn_implementation="sdpa"))
    norms = [param for name, param in built.named_parameters() if "norm" in name]
    partitioned = any(hasattr(param, "ds_id") for param in norms)
    gather: Any = contextlib.nullcontext()
    if partitioned:  # loaded under zero.Init: gather, change on rank 0, and DeepSpeed broadcasts on exit
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(norms, modifier_rank=0)
    with torch.no_grad(), gather:
        if not partitioned or dist.get_rank() == 0:
            for param in norms:
                param.add_(torch.randn_like(param) * 0.1)
    return built


def training_args(args: argparse.Namespace, output_dir: str) -> Any:
    from transformers import TrainingArguments

    _, _, _, batch = SHAPES[args.shape]
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=args.steps, logging_steps=1,
        learning_rate=1e-4, report_to=[], save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
        bf16=args.dtype == "bfloat16", deepspeed=deepspeed_config(args.stage, args.threshold),
        use_cpu=args.device == "cpu",
    )


def train(which: str, args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    import kernels_core
    from kernels_core import Mode
    from kernels_core.integrations.transformers import KernelizeCallback
    from transformers import Trainer
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    _, _, tokens, batch = SHAPES[args.shape]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(7)
    vocab = SHAPES[args.shape][0]["vocab_size"]
    data = [{"input_ids": (ids := torch.randint(3, vocab, (tokens,), generator=g)), "labels": ids}
            for _ in range(batch * args.steps * world)]
    callback = KernelizeCallback() if which in ("callback", "late") else None
    if which in ("plain-before", "before"):
        unset_hf_deepspeed_config()  # the earlier runs' arguments would load this model under zero.Init
        built = model(args)
        if which == "before":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else "cpu"
            kernels_core.kernelize(built.to(device), mode=Mode.TRAINING)
        targs = training_args(args, os.path.join(output_dir, which))
    else:
        targs = training_args(args, os.path.join(output_dir, which))  # ZeRO-3: the model loads under zero.Init
        built = model(args)
    partitioned_at_load = hasattr(built.lm_head.weight, "ds_id")
    trainer = Trainer(model=built, args=targs, train_dataset=data, callbacks=[callback] if which == "callback" else [])
    if which == "late":
        trainer.add_callback(callback)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.train()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    report = kernels_core.get_report(built)
    result = {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "wrapper": type(trainer.model_wrapped).__name__,
        "partitioned_at_load": partitioned_at_load,
        "partitioned": all(hasattr(p, "ds_id") for p in built.parameters()),
        "report": report,
        "loss_owner": callback.loss if callback else None,
        "tokens_per_s": args.steps * batch * tokens * world / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
    }
    trainer.accelerator.free_memory()
    del trainer, built
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, choices=(2, 3), default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of this script on DeepSpeed's CPU accelerator (gloo)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threshold", type=int, default=0,
                        help="ZeRO-3 stage3_param_persistence_threshold (default 0: every parameter partitioned, "
                             "norms included; -1 keeps DeepSpeed's default)")
    args = parser.parse_args()
    if args.threshold < 0:
        args.threshold = None

    # One process without a launcher: the variables torchrun would set.
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    set_distributed_env()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    import deepspeed

    # The process group before the first model: zero.Init sizes its partitions by the world size it sees then.
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    with tempfile.TemporaryDirectory(prefix="kernels-deepspeed-") as out:
        runs = {which: train(which, args, out) for which in RUNS}
    what = f"ZeRO-{args.stage} Trainer {args.shape} {args.dtype} x{os.environ['WORLD_SIZE']}"
    check(dist.is_initialized(), f"{what}: no process group")
    for which, run in runs.items():
        check(run["wrapper"] == "DeepSpeedEngine", f"{what} {which}: wrapped in {run['wrapper']}")
        if args.stage == 3:
            check(run["partitioned"], f"{what} {which}: parameters are not ZeRO-3 partitioned")
    check(runs["plain"]["partitioned_at_load"] is (args.stage == 3), f"{what}: zero.Init did not partition at load")
    tolerance = TOLERANCES[args.dtype]
    for which, reference in REFERENCE.items():
        run, plain = runs[which], runs[reference]
        check_report(run["report"], args.device, what=f"{what} {which}")
        residual = [e for e in run["report"].entries if e.kind == "residual_rms_norm"]
        check(bool(residual) and all(e.applied for e in residual),
              f"{what} {which}: residual add + norm not applied: {[(e.module, e.reason) for e in residual]}",
              run["report"])
        check(len(run["losses"]) == len(plain["losses"]) == args.steps,
              f"{what} {which}: {len(run['losses'])} / {len(plain['losses'])} logged losses, expected {args.steps}")
        worst = max(rel(k, p) for k, p in zip(run["losses"], plain["losses"], strict=True))
        check(worst <= tolerance, f"{what} {which}: losses differ from {reference} by {worst:.2e} relative "
                                  f"(tolerance {tolerance}): {run['losses']} vs {plain['losses']}", run["report"])
        log(f"{what} {which}: worst relative loss difference to {reference} {worst:.2e} over {args.steps} steps")
    check("kernels-core's fused loss" in (runs["callback"]["loss_owner"] or ""),
          f"{what}: loss owner is {runs['callback']['loss_owner']!r}", runs["callback"]["report"])
    for which, run in runs.items():
        log(f"{what} {which}: {run['tokens_per_s']:,.0f} tokens/s, peak {run['peak_gib']:.2f} GiB (rank 0)")
    log(f"{what}: OK; {runs['callback']['report'].summary()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
