"""LLaMA-Factory v1's SFT trainer with and without ``kernel_config: {name: kernels_core}``, on packed rows.

LLaMA-Factory v1 packs a micro batch into one row with ``batching_strategy: dynamic_padding_free`` (restarting
position ids and an all-ones attention mask, so transformers' sdpa attends across the documents of the row, with
the plugin or without: the packed-attention kernel does not run there, by design). This benchmark runs that path as
a LLaMA-Factory user does: ``ModelEngine`` loads a model directory (the ``--model`` shape from ``models_bench.py``,
randomly initialised, with a byte-level tokenizer written here: no download), ``SFTTrainer(...).fit()`` trains it
with LLaMA-Factory's defaults for full fine-tuning on one device (float32 weights, activation checkpointing,
``torch.optim.AdamW``). Each variant runs in a fresh process: ``plain`` (no kernel configuration) and ``kernels``
(the kernels_core ``KernelPlugin``, which kernelizes the model as it loads). Reported: tokens/s over the steps after
warm-up (real tokens: the rows hold no padding), peak memory, every step's loss, and the kernelize report.

    python -m benchmarks.cuda.llamafactory_bench --out benchmarks/results/llamafactory-qwen3-0.6b-h200.json
    python -m benchmarks.cuda.llamafactory_bench --tiny --device cpu --out /tmp/lf.json   # smoke test, seconds

Needs ``llamafactory`` (0.9.5, its v1 trainer) and the packages it imports; kernels-core's LLaMA-Factory tests run
in the same environment (``nox -s llamafactory``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from benchmarks.common import child_result
from benchmarks.common import environment
from benchmarks.common import python_m
from benchmarks.common import settle_cpp_extension
from benchmarks.common import write_json


VARIANTS = ("plain", "kernels")


# Words the tokenizer of save_tiny_chat_model was trained on (one token each, mostly): what the text says does not
# matter, only that samples reach the cut.
_WORDS = "the quick brown fox jumps over a lazy dog while kernels fuse norms and rotary embeddings".split()


def _words(count: int, seed: int) -> str:
    return " ".join(_WORDS[(seed * 7 + 3 * i) % len(_WORDS)] for i in range(count))


def prepare(workdir: pathlib.Path, *, shape: str, tiny: bool, samples: int, seq: int) -> tuple[str, str]:
    """The model directory and the SFT data set: ``samples`` conversations whose answers reach ``seq`` tokens
    (LLaMA-Factory cuts each sample at ``cutoff_len`` = ``seq``)."""
    from kernels_core.testing import save_tiny_chat_model

    from benchmarks.cuda.models_bench import MODELS

    settings = {} if tiny else {k: v for k, v in MODELS[shape].items() if k != "family"}
    family = "qwen3" if tiny else MODELS[shape]["family"]
    model_dir = save_tiny_chat_model(workdir / "model", model_type=family, **settings)
    rows = [{"messages": [
        {"role": "user", "content": [{"type": "text", "value": _words(8, i)}], "loss_weight": 0.0},
        # More words than the cut keeps: every sample is exactly seq tokens after LLaMA-Factory's truncation.
        {"role": "assistant", "content": [{"type": "text", "value": _words(seq, i + 1)}], "loss_weight": 1.0},
    ]} for i in range(samples)]
    data = workdir / "sft.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(model_dir), str(data)


def run_variant(variant: str, *, model_dir: str, data: str, output_dir: str, steps: int, warmup: int, batch: int,
                seq: int, batching: str, device: str) -> dict:
    import kernels_core
    import kernels_core.integrations.llamafactory  # noqa: F401  (registers KernelPlugin("kernels_core"))
    import torch
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config import get_args
    from llamafactory.v1.core.data_engine import DataEngine
    from llamafactory.v1.core.model_engine import ModelEngine
    from llamafactory.v1.trainers.sft_trainer import SFTTrainer
    from llamafactory.v1.utils.callbacks.trainer_callback import TrainerCallback

    cuda = device == "cuda"
    args = {"model": model_dir, "template": "chatml", "train_dataset": data, "output_dir": output_dir,
            "micro_batch_size": batch, "global_batch_size": batch, "cutoff_len": seq, "max_steps": steps,
            "learning_rate": 1e-5, "batching_workers": 0, "batching_strategy": batching, "seed": 0,
            "logging_steps": 1}
    if variant == "kernels":
        args["kernel_config"] = {"name": "kernels_core"}
    model_args, data_args, training_args, _ = get_args(args)
    DistributedInterface(training_args.dist_config)
    engine = ModelEngine(model_args, is_train=True)
    tokens: list[int] = []
    stamps: list[float] = []

    def count(module, call_args, kwargs):
        ids = kwargs.get("input_ids")
        tokens.append(int(ids.numel()) if ids is not None else 0)

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    engine.model.base_model.register_forward_pre_hook(count, with_kwargs=True)
    if variant == "kernels" and cuda:
        settle_cpp_extension()  # steady-state numbers: the norms' C++ autograd nodes load in the background
    trainer = SFTTrainer(args=training_args, model=engine.model, renderer=engine.renderer,
                         train_dataset=DataEngine(data_args.train_dataset), callbacks=[Stamp()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit()
    # One micro batch a step (global = micro batch size, one process): one forward of the backbone a step.
    step_tokens = tokens[-len(stamps):]
    timed = step_tokens[warmup + 1:]
    steady = sum(timed) / (stamps[-1] - stamps[warmup]) if len(stamps) > warmup + 1 else None
    report = kernels_core.get_report(engine.model)
    return {
        "variant": variant,
        "batching_strategy": batching,
        "dtype": str(next(engine.model.parameters()).dtype),
        "activation_checkpointing": bool(getattr(engine.model, "is_gradient_checkpointing", False)),
        "optimizer": type(trainer.optimizer).__name__,
        "tokens_per_step": step_tokens,
        "steady_tokens_per_second": steady,
        "run_s": time.perf_counter() - start,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "kernelize": report.summary() if report is not None else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--model", default="qwen3-0.6b", help="a models_bench.py shape")
    parser.add_argument("--tiny", action="store_true", help="save_tiny_chat_model's 2-layer model (smoke test)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="samples per micro batch (one packed row)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sample (LLaMA-Factory's cutoff_len)")
    parser.add_argument("--batching", default="dynamic_padding_free",
                        help="LLaMA-Factory v1 batching_strategy (dynamic_padding_free packs; normal pads)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/llamafactory-bench"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        result = run_variant(opts.one, model_dir=opts.model_dir, data=opts.data,
                             output_dir=str(opts.workdir / opts.one), steps=opts.steps, warmup=opts.warmup,
                             batch=opts.batch, seq=opts.seq, batching=opts.batching, device=opts.device)
        print("RESULT " + json.dumps(result))
        return 0
    seq = 64 if opts.tiny else opts.seq
    model_dir, data = prepare(opts.workdir, shape=opts.model, tiny=opts.tiny,
                              samples=opts.batch * (opts.steps + 1), seq=seq)
    results: dict[str, dict] = {}
    for variant in opts.variants.split(","):
        cmd = python_m("benchmarks.cuda.llamafactory_bench", "--one", variant, "--out", str(opts.out),
                       "--model-dir", model_dir, "--data", data, "--steps", str(opts.steps), "--warmup",
                       str(opts.warmup), "--batch", str(opts.batch), "--seq", str(seq), "--batching", opts.batching,
                       "--device", opts.device, "--workdir", str(opts.workdir))
        results[variant] = result = child_result(cmd, variant)
        if "error" in result:
            continue
        print(f"{variant:8s} {result['steady_tokens_per_second'] or 0:9.0f} tok/s  peak "
              f"{result['peak_memory_gib'] or 0:.2f} GiB  losses {result['losses'][0]:.4f} .. "
              f"{result['losses'][-1]:.4f}", flush=True)
    plain, kernels = results.get("plain", {}), results.get("kernels", {})
    summary = {}
    if plain.get("steady_tokens_per_second") and kernels.get("steady_tokens_per_second"):
        summary["kernels_vs_plain_tokens"] = kernels["steady_tokens_per_second"] / plain["steady_tokens_per_second"]
    if plain.get("peak_memory_gib") and kernels.get("peak_memory_gib"):
        summary["kernels_vs_plain_memory"] = kernels["peak_memory_gib"] / plain["peak_memory_gib"]
    if plain.get("losses") and kernels.get("losses"):
        summary["max_rel_loss_gap"] = max(abs(a - b) / abs(b) for a, b in
                                          zip(kernels["losses"], plain["losses"], strict=True))
    print(json.dumps(summary, indent=2))
    shape = ("save_tiny_chat_model's 2-layer model" if opts.tiny else f"{opts.model} shape") + (
        f", LLaMA-Factory v1 SFT, batching_strategy {opts.batching}, {opts.batch} samples of {seq} tokens a micro "
        "batch, one micro batch a step, LLaMA-Factory's full-tuning defaults (float32, activation checkpointing, "
        "AdamW)")
    import torch

    where = environment() if opts.device == "cuda" else {"device": "cpu", "torch": torch.__version__}
    write_json(opts.out, {"environment": where, "shape": shape, "steps": opts.steps,
                          "warmup_steps": opts.warmup, "summary": summary, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
