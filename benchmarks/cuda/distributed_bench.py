"""Training under FSDP2 (and DDP) on several GPUs: eager against kernelize called before and after wrapping, and
torch.compile per decoder layer with and without kernelize. Every variant runs in the same torchrun job, one after
the other, from the same seeds and data; ``--nprocs`` repeats the job at several GPU counts and reports scaling.

    torchrun --nproc_per_node 2 -m benchmarks.cuda.distributed_bench --out /tmp/out/cuda-distributed.json
    python -m benchmarks.cuda.distributed_bench --nprocs 1,2 --variants eager,kernelize_before \
        --out benchmarks/results/distributed-2xh200.json                      # scaling at 1 and 2 GPUs
    torchrun --nproc_per_node 2 -m benchmarks.cuda.distributed_bench --model qwen3-30b-a3b-4l --batch 2 \
        --seq 4096 --variants eager,kernelize_before,compile,kernelize_compile --out /tmp/moe.json
    torchrun --nproc_per_node 2 -m benchmarks.cuda.distributed_bench --model llama-3.1-8b-4l --layers 32 --batch 1 \
        --seq 4096 --variants kernelize_compile,kernelize_compile_fp8_rowwise,kernelize_compile_fp8_tensorwise \
        --out /tmp/fp8.json                                                    # FP8 against bf16, FSDP2
    torchrun --nproc_per_node 2 -m benchmarks.cuda.distributed_bench --variants \
        ds_zero3,ds_zero3_kernelize_before,ds_zero3_kernelize_after --out /tmp/zero3.json   # DeepSpeed ZeRO-3
    torchrun --nproc_per_node 2 -m benchmarks.cuda.distributed_bench --peft qlora \
        --variants eager,kernelize_before,kernelize_after,liger --out /tmp/qlora.json    # QLoRA under FSDP2
    torchrun --nproc_per_node 2 -m benchmarks.cuda.distributed_bench --out /tmp/x.json --device cpu --tiny  # smoke

Models: ``qwen3-0.6b`` (default) or any shape of ``models_bench.py`` (``qwen3-30b-a3b-4l``, ``mixtral-8x7b-2l``,
``gemma-3-4b-6l``, ``llama-3.1-8b-4l``), bf16 parameters, sdpa. Variants: ``eager`` (FSDP2: ``fully_shard`` on
each decoder layer, then on the root; parameters already bf16, so no mixed-precision policy),
``kernelize_before`` (``kernelize(mode=TRAINING)`` then ``fully_shard``), ``kernelize_after`` (``fully_shard``
then ``kernelize``), ``compile`` and ``kernelize_compile`` (``torch.compile`` on each decoder layer before
``fully_shard``, the usual FSDP2 recipe; the latter kernelized with ``TRAINING | TORCH_COMPILE`` first), and
``ddp_eager``, ``ddp_kernelize_before``, ``ddp_kernelize_after`` under DDP; ``liger``: Liger-Kernel's
per-instance model patch (as the Trainer's ``use_liger_kernel`` applies it) before ``fully_shard``, and the
kernelized FSDP2 variants are also compared with it. ``kernelize_compile_fp8_rowwise`` and
``kernelize_compile_fp8_tensorwise``: ``kernelize_compile`` with every decoder-layer linear asked for kernels-cuda's
FP8 kernel of that scaling recipe (``[kinds.linear] prefer``; an explicit request, so where it cannot run, as on
the CPU, the variant's row carries kernelize's refusal), compared with ``kernelize_compile`` where it is in the job,
else ``compile``. ``ds_zero2`` and ``ds_zero3``: DeepSpeed ZeRO-2 / ZeRO-3 (``deepspeed.initialize`` with
AdamW as the client optimizer, bf16, ``engine.backward`` and ``engine.step``), with ``ds_zero2_kernelize_before``,
``ds_zero2_kernelize_after``, ``ds_zero3_kernelize_before`` and ``ds_zero3_kernelize_after`` kernelizing the
module before ``deepspeed.initialize`` or ``engine.module`` after it, compared with the plain run of their stage
(deepspeed is optional: without it those rows name ``pip install "kernels-core[deepspeed]"``). ``--peft lora``,
``lora_lm_head`` or ``qlora`` trains PEFT LoRA adapters (r 16, alpha 32, dropout 0.05) in every variant of the job,
added before kernelize and wrapping (QLoRA: the base saved and loaded again 4-bit nf4 by bitsandbytes with bf16
quant storage, CUDA only; FSDP2 shards the frozen base and the adapters alike); with ``lora_lm_head`` every row
records whether the ``lm_head`` adapter trained. ``--layers`` sets the depth (``--model llama-3.1-8b-4l
--layers 32``: the Llama-3.1-8B shape at full depth). Batch 4 x 2048 tokens per rank by default, AdamW(fused,
lr 1e-5) as in ``qwen3_bench.py`` (``--optimizer foreach``: torch's multi-tensor AdamW).
Measured per variant: global tokens/s over the timed steps
(after warm-up, between synchronise + barrier), the first step's seconds, peak allocated GiB per rank over the
timed steps, the loss of every step (mean over ranks), and from ``get_report``: the kernel each layer kind got and
what was declined, and why. Rank 0 writes the JSON (rewritten after every variant, so a later hang still leaves
the earlier results) and prints a table and the targets: kernelize in either order >= 1.15x eager tokens/s,
<= 0.45x its peak per rank, losses within 1e-3 relative, and before/after within 3% of each other with identical
kernel choices; FP8 >= 1.25x its baseline's tokens/s with losses within 1.5%; a kernelized ZeRO variant >= 1.15x
its plain run at no more peak memory, losses within 1e-3. With ``--nprocs``, the scaling efficiency per variant
(tokens/s per GPU at N GPUs over 1 GPU's).

**FSDP2's host tax.** ``kernelize_compile_after``: the decoder layers compiled one by one before ``fully_shard``
(as ``compile``), then ``kernelize(TRAINING | TORCH_COMPILE)`` after it, the counterpart of ``kernelize_compile``.
Modifiers on any FSDP2 variant: ``+prefetch<N>`` has each decoder layer's unit all-gather the next N layers'
parameters in forward and the previous N in backward (``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``; FSDP2's implicit prefetch is one), ``+noreshard`` keeps the layers' gathered
parameters from forward to backward (``reshard_after_forward=False``) for that variant alone, ``+localstep`` has
AdamW step on the local shards (``kernels_core.optim.step_on_local_shards``: no DTensor dispatch). On compiled
variants, ``+cudagraphs`` compiles each decoder layer with ``mode="reduce-overhead"`` (Inductor's CUDA graph trees:
every layer's forward and backward graph replayed as one CUDA graph, FSDP2's hooks running between them) and marks
each training step's start (``torch.compiler.cudagraph_mark_step_begin``); the row records Inductor's CUDA graph
counters (``cudagraphs``: re-recordings and skips, with their reasons). On compiled kernelize variants,
``+compilenative`` leaves the elementwise kinds (:data:`COMPILE_NATIVE_KINDS`: RMSNorm, residual add + RMSNorm,
rotary embedding, gated MLP) to Inductor (kernelize ``config`` with ``enabled = false`` for each), keeping the
loss, attention, mask and MoE kernels. Each kernelize
before / after pair with the same modifiers (and ``kernelize_compile`` / ``kernelize_compile_after``) is compared:
tokens/s within 3% (median of ``--rounds`` alternating rounds) and identical kernel choices. On one GPU the
kernelized variants' target is >= 1.6x eager. Every row lists how long the host took to issue each timed step
(``host_issue_ms_each_step``, no synchronisation): in a host-bound step a pause shows there. ``--gc freeze``
calls ``gc.freeze()`` after each variant's warm-up, so that no collection walks what the model and its compiled
graphs keep alive, and ``gc.unfreeze()`` after its timed steps.

**Floor accounting** (:mod:`benchmarks.cuda.floor`; ``--no-floor`` skips it): before the variants every rank times
the step's parts alone (GEMMs with cuBLAS, SDPA, memory-bound work and AdamW at the copy bandwidth) and FSDP2's
all-gather and reduce-scatter of each unit's parameters; each FSDP2 row gains ``floor_ms`` (per rank and step,
exposed communication included), ``floor_fraction`` (floor / measured step) and ``floor``, the breakdown.

``--device cpu`` runs on gloo (no timing or memory worth reading; peak memory is not measured): a smoke test of
the script and of kernelize under FSDP2/DDP/DeepSpeed (its CPU accelerator) on a machine without GPUs.
``--tiny`` shrinks the model and batch.
Exit status 1 when a variant raised (its traceback is in the JSON), 0 otherwise; missed targets are printed and
recorded, not an error.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import PEFT_TARGETS
from benchmarks.common import QWEN3_0_6B
from benchmarks.common import alternating_rounds
from benchmarks.common import distributed_workers
from benchmarks.common import environment
from benchmarks.common import fp8_linear_config
from benchmarks.common import host_profile_step
from benchmarks.common import modeling_globals_kept
from benchmarks.common import profile_by_category
from benchmarks.common import profile_step
from benchmarks.common import require_cuda_kernels
from benchmarks.common import settle_cpp_extension
from benchmarks.common import trace_step
from benchmarks.common import with_lora
from benchmarks.common import write_json
from benchmarks.cuda import floor
from benchmarks.cuda import models_bench
from benchmarks.cuda import qwen3_bench
from benchmarks.cuda._scaling import combine
from benchmarks.cuda._scaling import scale


GIB = 2**30

# name -> (wrapper, when kernelize runs relative to wrapping; None = not kernelized)
VARIANTS: dict[str, tuple[str, str | None]] = {
    "eager": ("fsdp", None),
    "kernelize_before": ("fsdp", "before"),
    "kernelize_after": ("fsdp", "after"),
    "compile": ("fsdp", None),
    "kernelize_compile": ("fsdp", "before"),
    "kernelize_compile_after": ("fsdp", "after"),
    "liger": ("fsdp", None),
    "ddp_eager": ("ddp", None),
    "ddp_kernelize_before": ("ddp", "before"),
    "ddp_kernelize_after": ("ddp", "after"),
    "kernelize_compile_fp8_rowwise": ("fsdp", "before"),
    "kernelize_compile_fp8_tensorwise": ("fsdp", "before"),
    "ds_zero2": ("zero2", None),
    "ds_zero2_kernelize_before": ("zero2", "before"),
    "ds_zero2_kernelize_after": ("zero2", "after"),
    "ds_zero3": ("zero3", None),
    "ds_zero3_kernelize_before": ("zero3", "before"),
    "ds_zero3_kernelize_after": ("zero3", "after"),
}
DEFAULT_VARIANTS = ("eager", "kernelize_before", "kernelize_after", "ddp_eager", "ddp_kernelize_before",
                    "ddp_kernelize_after")
# kernelize_compile with every decoder-layer linear asked for kernels-cuda's FP8 kernel of this scaling recipe.
FP8 = {"kernelize_compile_fp8_rowwise": "rowwise", "kernelize_compile_fp8_tensorwise": "tensorwise"}
COMPILED = {"compile", "kernelize_compile", "kernelize_compile_after", *FP8}
# Modifiers of an FSDP2 variant's sharding (``name+prefetch2+noreshard``): see the module.
PREFETCH = re.compile(r"prefetch(\d+)")
MODIFIERS = ("noreshard", "localstep", "cudagraphs", "compilenative")
# The kinds +compilenative leaves to Inductor: elementwise work it fuses into the neighbouring operations.
COMPILE_NATIVE_KINDS = ("rms_norm", "residual_rms_norm", "rotary_embedding", "silu_gated_mlp", "gelu_gated_mlp")
# Variants patched by Liger-Kernel (its per-instance model patch, as the Trainer's use_liger_kernel applies it).
LIGER = {"liger"}
BASELINE = {"fsdp": "eager", "ddp": "ddp_eager", "zero2": "ds_zero2", "zero3": "ds_zero3"}
# DeepSpeed wrappers: deepspeed.initialize around the module at this ZeRO stage, AdamW as the client optimizer.
ZERO_STAGE = {"zero2": 2, "zero3": 3}
DEEPSPEED_MISSING = 'deepspeed is not installed: pip install "kernels-core[deepspeed]"'
# A smoke-test size: every code path of the real run in seconds on CPU (models_bench's, shared).
TINY = models_bench.TINY
TINY_EXTRA = models_bench.TINY_EXTRA
DEFAULT_MODEL = "qwen3-0.6b"

TARGET_SPEEDUP = 1.15
# One GPU, one unit per decoder layer: the issue's target for the kernelized FSDP2 step against eager.
TARGET_SPEEDUP_ONE_GPU = 1.6
TARGET_PEAK = 0.45
TARGET_LOSS_REL = 1e-3
TARGET_BEFORE_AFTER = 0.03
# FP8 (issue targets: the Llama-3.1-8B shape under FSDP2): >= 1.25x kernelize + compile in bf16. Random tokens are
# no learnable task, so the loss bound is FP8's accuracy target of 1.5% relative, not the bf16 variants' 1e-3.
TARGET_FP8_SPEEDUP = 1.25
TARGET_FP8_LOSS_REL = 0.015
# DeepSpeed ZeRO-2/3: kernelized >= 1.15x the plain engine's tokens/s at no more peak memory.
TARGET_ZERO_SPEEDUP = 1.15


def split_variant(name: str) -> tuple[str, list[str]]:
    """(base variant, modifiers) of a variant name such as ``kernelize_before+prefetch2+noreshard``.

    Example:
        >>> split_variant("kernelize_after+prefetch2+noreshard")
        ('kernelize_after', ['prefetch2', 'noreshard'])
    """
    base, *modifiers = name.split("+")
    return base, modifiers


def variant_problem(name: str) -> str | None:
    """Why ``name`` is no variant of this benchmark, or None.

    Example:
        >>> variant_problem("kernelize_compile+localstep+compilenative+cudagraphs") is None
        True
        >>> variant_problem("compile+compilenative")
        "'compilenative' in 'compile+compilenative' applies to compiled kernelize variants only"
        >>> variant_problem("kernelize_before+cudagraphs")[:45]
        "'cudagraphs' in 'kernelize_before+cudagraphs'"
    """
    base, modifiers = split_variant(name)
    if base not in VARIANTS:
        return f"unknown variant {base!r}; choose from {list(VARIANTS)}"
    for modifier in modifiers:
        if modifier not in MODIFIERS and not PREFETCH.fullmatch(modifier):
            return (f"unknown modifier {modifier!r} in {name!r}; expected prefetch<N> or one of "
                    f"{', '.join(MODIFIERS)}")
        if VARIANTS[base][0] != "fsdp":
            return f"{modifier!r} in {name!r} applies to FSDP2 variants only"
        if modifier == "compilenative" and (base not in COMPILED or VARIANTS[base][1] is None):
            return f"'compilenative' in {name!r} applies to compiled kernelize variants only"
        if modifier == "cudagraphs" and base not in COMPILED:
            return f"'cudagraphs' in {name!r} applies to compiled variants only ({sorted(COMPILED)})"
    return None


def setup(device_type: str) -> torch.device:
    """The process group, with the NVLink-multicast switches of the lent hosts; the GPU tests' own setup."""
    return distributed_workers().init_distributed(device_type)


def _normalise(module_name: str) -> str:
    """The module path as if unwrapped: DDP adds a leading ``module.``; FSDP2 keeps the names."""
    # torch.compile's wrapper adds ``_orig_mod.`` below each compiled layer when kernelize runs after it.
    return re.sub(r"^module(\.|$)", "", module_name).replace("._orig_mod", "")


def summarise_report(report: Any) -> dict[str, Any]:
    """Kernels per kind, declines grouped by (kind, reason), and the (module, kind) -> kernel map compared later."""
    kernels: dict[str, Counter[str]] = {}
    declined: Counter[tuple[str, str]] = Counter()
    choices: dict[str, str | None] = {}
    for entry in report.entries:
        choices[f"{_normalise(entry.module) or '(model)'}|{entry.kind}"] = entry.kernel
        if entry.applied:
            kernels.setdefault(entry.kind, Counter())[entry.kernel] += 1
        else:
            declined[(entry.kind, entry.reason or "")] += 1
    return {
        "summary": report.summary(),
        "kernels": {kind: dict(counter) for kind, counter in kernels.items()},
        "declined": [{"kind": k, "reason": r, "count": n} for (k, r), n in sorted(declined.items())],
        "declined_total": sum(declined.values()),
        "choices": choices,
    }


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM, or of the one inside a PEFT model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def wrap(model: torch.nn.Module, how: str, device: torch.device, *, reshard_after_forward: bool = True,
         layers_per_unit: int = 1) -> torch.nn.Module:
    """FSDP2 or DDP as the distributed GPU tests wrap; a PEFT model's decoder layers sit deeper, so FSDP2 shards
    them here the same way (one unit per ``layers_per_unit`` layers, then the root), frozen base weights and LoRA
    weights alike."""
    if how != "fsdp" or not hasattr(model, "get_base_model"):
        return distributed_workers().wrap(model, how, device, reshard_after_forward=reshard_after_forward,
                                          layers_per_unit=layers_per_unit)
    from torch.distributed.fsdp import fully_shard

    layers = list(decoder_layers(model))
    for start in range(0, len(layers), layers_per_unit):
        group = layers[start:start + layers_per_unit]
        fully_shard(group if len(group) > 1 else group[0], reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    return model


def set_prefetch(model: torch.nn.Module, count: int, *, layers_per_unit: int) -> None:
    """Each decoder layer's FSDP2 unit all-gathers the next ``count`` layers' parameters when its forward starts
    and the previous ``count`` when its backward starts (FSDP2 prefetches one on its own)."""
    if layers_per_unit != 1:
        raise ValueError("prefetch<N> needs one FSDP2 unit per decoder layer (--layers-per-unit 1)")
    layers = list(decoder_layers(model))
    for index, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[index + 1:index + 1 + count])
        layer.set_modules_to_backward_prefetch(layers[max(0, index - count):index][::-1])


def deepspeed_engine(model: torch.nn.Module, *, stage: int, batch: int, optimizer: torch.optim.Optimizer) -> Any:
    """``deepspeed.initialize`` around ``model`` at ZeRO-``stage`` with ``optimizer`` as the client optimizer, bf16,
    ``batch`` sequences per rank, no gradient accumulation or clipping (as the FSDP2 variants)."""
    try:
        import deepspeed
    except ImportError as exc:
        raise RuntimeError(DEEPSPEED_MISSING) from exc
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class CollectorPauses:
    """A ``gc.callbacks`` entry: how many collections of each generation ran, and for how long in all.

    Example:
        >>> pauses = CollectorPauses()
        >>> gc.callbacks.append(pauses)
        >>> _ = gc.collect()
        >>> gc.callbacks.remove(pauses)
        >>> pauses.summary()["2"]["count"]
        1
    """

    def __init__(self) -> None:
        self._started = 0.0
        self._count = [0, 0, 0]
        self._seconds = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._count[info["generation"]] += 1
            self._seconds[info["generation"]] += time.perf_counter() - self._started

    def summary(self) -> dict[str, dict[str, float]]:
        """Per generation: collections and their total milliseconds."""
        return {str(g): {"count": self._count[g], "ms": round(1e3 * self._seconds[g], 2)} for g in range(3)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def baseline(name: str, *, ran: Collection[str]) -> str:
    """The run a variant is compared with: compile for kernelize_compile (and kernelize_compile_after); for an
    FP8 variant kernelize_compile where it is in the job (``ran``), else compile; else the same wrapper's plain run
    (a ZeRO stage's plain DeepSpeed run for its kernelized variants). A variant with modifiers is compared with
    that run under the same modifiers where it ran, else with the plain one."""
    base, modifiers = split_variant(name)
    if base in FP8:
        plain = "kernelize_compile" if "kernelize_compile" in ran else "compile"
    elif base in ("kernelize_compile", "kernelize_compile_after"):
        plain = "compile"
    else:
        plain = BASELINE[VARIANTS[base][0]]
    same = "+".join([plain, *modifiers])
    return same if modifiers and same in ran and same != name else plain


def build_model(name: str, *, tiny: bool, device: torch.device, layers: int | None = None) -> torch.nn.Module:
    """A seeded bf16 model of the Qwen3-0.6B shape or of one of ``models_bench.MODELS``; ``layers`` overrides the
    decoder depth (``llama-3.1-8b-4l`` with 32 is the Llama-3.1-8B shape at full depth)."""
    depth = {} if layers is None else {"num_hidden_layers": layers}
    if name == DEFAULT_MODEL:
        model = qwen3_bench.build(seed=0, device=str(device), **{**(TINY if tiny else {}), **depth})
    else:
        overrides = {**TINY, **TINY_EXTRA[models_bench.MODELS[name]["family"]]} if tiny else {}
        model = models_bench.build(name, device=str(device), **{**overrides, **depth})
    # Training builds no cache (the Trainer's default, TrainingArguments.use_cache=False). With one, every layer
    # hands the cache its own layer_idx, and torch.compile of one layer at a time traces each layer again until
    # Dynamo's recompile limit (8) leaves the rest uncompiled.
    model.config.use_cache = False
    return model


def vocab_size(name: str, *, tiny: bool) -> int:
    if tiny:
        return TINY["vocab_size"]
    if name == DEFAULT_MODEL:
        return QWEN3_0_6B["vocab_size"]
    return models_bench.MODELS[name]["vocab_size"]


def run_variant(name: str, args: argparse.Namespace, device: torch.device, batches: torch.Tensor) -> dict[str, Any]:
    import kernels_core

    base, modifiers = split_variant(name)
    how, order = VARIANTS[base]
    compiled = base in COMPILED
    world = dist.get_world_size()
    _free(device)
    reshard = not (args.no_reshard or "noreshard" in modifiers)
    prefetch = next((int(m.group(1)) for m in map(PREFETCH.fullmatch, modifiers) if m), None)
    graphs = "cudagraphs" in modifiers  # compiled layers replayed as CUDA graphs (variant_problem: compiled only)
    result: dict[str, Any] = {"variant": name, "wrapper": how, "kernelize": order, "compiled": compiled,
                              "peft": args.peft, "reshard_after_forward": reshard, "prefetch": prefetch}
    if base in FP8:
        result["fp8"] = FP8[base]
    if device.type == "cuda":
        # What the previous variant left behind: should be ~0, or the peaks below are not comparable.
        result["allocated_at_start_GiB"] = round(torch.cuda.memory_allocated(device) / GIB, 4)

    if how in ZERO_STAGE and importlib.util.find_spec("deepspeed") is None:
        raise RuntimeError(DEEPSPEED_MISSING)  # before building anything: the reason, not a traceback
    model = build_model(args.model, tiny=args.tiny, device=device, layers=args.layers)
    if args.peft is not None:
        # LoRA before everything else, in every variant (the Trainer gets a PEFT model and wraps it likewise).
        with tempfile.TemporaryDirectory(prefix=f"distributed-bench-{args.peft}-{dist.get_rank()}-") as tmp:
            model = with_lora(model, args.peft, tmp)
    model.train()
    if base in LIGER:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        # The Trainer patches a PEFT model's base model.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        _apply_liger_kernel_to_instance(model=base)
    if order == "before":
        mode = kernels_core.Mode.TRAINING | (kernels_core.Mode.TORCH_COMPILE if compiled else kernels_core.Mode(0))
        kernels_core.kernelize(model, mode=mode, config=kernelize_config(base, modifiers))
    if compiled:
        # Each decoder layer compiled on its own, then sharded: FSDP2's hooks stay outside the compiled graphs.
        layers = decoder_layers(model)
        for index, layer in enumerate(layers):
            layers[index] = torch.compile(layer, mode="reduce-overhead" if graphs else None)
    fused = args.optimizer == "fused" and device.type == "cuda"
    batch_size = batches.shape[1]
    if how in ZERO_STAGE:
        # The client optimizer over the module's trainable parameters; DeepSpeed replaces them by its partitions.
        client = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=fused,
                                   foreach=None if fused else True)
        runner = deepspeed_engine(model, stage=ZERO_STAGE[how], batch=batch_size, optimizer=client)
    else:
        runner = wrap(model, how, device, reshard_after_forward=reshard, layers_per_unit=args.layers_per_unit)
        if prefetch:
            set_prefetch(model, prefetch, layers_per_unit=args.layers_per_unit)
    if order == "after":
        # DeepSpeed's engine is no nn.Module wrapper kernelize walks into: kernelize the module it trains. The
        # compiled layers are traced at their first call, after this, so they trace the bound kernels.
        mode = kernels_core.Mode.TRAINING | (kernels_core.Mode.TORCH_COMPILE if compiled else kernels_core.Mode(0))
        kernels_core.kernelize(runner.module if how in ZERO_STAGE else runner, mode=mode,
                               config=kernelize_config(base, modifiers))
    if order is not None:
        # The report lives on the module kernelize was given: the bare model, or the wrapper (DDP) around it.
        report = kernels_core.get_report(model if order == "before" or how in ZERO_STAGE else runner)
        result["report"] = summarise_report(report)
        if dist.get_rank() == 0 and args.print_report:
            print(f"--- {name}\n{report.table()}", flush=True)
        if device.type == "cuda":
            require_cuda_kernels(report)

    losses: list[torch.Tensor] = []
    if how in ZERO_STAGE:
        engine = runner

        def step(batch: torch.Tensor) -> torch.Tensor:
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()  # the optimizer step and zeroing of the gradients
            return loss.detach()
    else:
        opt = torch.optim.AdamW([p for p in runner.parameters() if p.requires_grad], lr=1e-5, fused=fused,
                                foreach=None if fused else True)
        if "localstep" in modifiers:
            from kernels_core.optim import step_on_local_shards

            result["optimizer"] = step_on_local_shards(opt).describe()

        def step(batch: torch.Tensor) -> torch.Tensor:
            if graphs:
                # A new step: the graphs' outputs of the last one (activations, gradients) are no longer read.
                torch.compiler.cudagraph_mark_step_begin()
            loss = runner(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

    # A LoRA adapter on lm_head must train through whatever computes the loss (a fused loss reading the frozen
    # base weight alone would leave it as it was): this rank's part of it, before and after.
    head_adapter = {n: _local(p).detach().clone() for n, p in model.named_parameters()
                    if "lm_head" in n and "lora_" in n}
    # The same dropout masks (LoRA's) in every variant: the random state depends on what ran before otherwise.
    torch.manual_seed(2000 + dist.get_rank())

    _sync(device)
    first = time.perf_counter()
    for i in range(args.warmup):
        losses.append(step(batches[i]))
        if i == 0:
            _sync(device)
            result["first_step_s"] = round(time.perf_counter() - first, 2)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if args.gc == "freeze":
        # What long-running training loops do against collector pauses: everything alive after the warm-up (the
        # model, compiled graphs, imported modules) moves to the permanent generation, which no collection walks.
        gc.collect()
        gc.freeze()
    pauses = CollectorPauses()
    gc.callbacks.append(pauses)
    start = time.perf_counter()
    issued = [start]  # when the host finished issuing each step (no synchronisation: the GPU may still run it)
    try:
        for i in range(args.steps):
            losses.append(step(batches[args.warmup + i]))
            issued.append(time.perf_counter())
        _sync(device)  # the barrier makes the clock include the slowest rank
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    finally:
        gc.callbacks.remove(pauses)
        if args.gc == "freeze":
            gc.unfreeze()  # this variant's objects become collectable again before the next one is built
    result["gc_during_timed_steps"] = pauses.summary()
    result["host_issue_ms_each_step"] = [round(1e3 * (b - a), 1) for a, b in itertools.pairwise(issued)]
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)

    mean_losses = torch.stack(losses).float()
    dist.all_reduce(mean_losses)  # SUM: gloo has no AVG
    mean_losses /= world
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    peaks: list[float | None] = [None] * world
    dist.all_gather_object(peaks, peak)

    tokens = world * batches.shape[1] * batches.shape[2] * args.steps
    result.update(
        tokens_per_s=tokens / elapsed.item(),
        step_ms=1e3 * elapsed.item() / args.steps,
        peak_GiB_per_rank=[None if p is None else round(p, 4) for p in peaks],
        peak_GiB=None if peak is None else round(max(peaks), 4),
        losses=[round(v, 6) for v in mean_losses.tolist()],
    )
    if graphs:
        result["cudagraphs"] = cudagraph_record(device)
    if args.localstep_ab and how == "fsdp":
        result["localstep_ab"] = localstep_ab(step, opt, batches, device, rounds=args.localstep_ab,
                                              steps=args.steps)
    if head_adapter:
        now = dict(model.named_parameters())
        changed = torch.tensor([float(any(not torch.equal(_local(now[n]).detach(), before)
                                          for n, before in head_adapter.items()))], device=device)
        dist.all_reduce(changed)  # SUM over ranks: a rank may hold no part of the adapter
        result["lm_head_adapter_trained"] = bool(changed.item() > 0)
    if args.profile and device.type == "cuda":
        _sync(device)
        start = time.perf_counter()
        kernels = profile_step(lambda: step(batches[0]))
        _sync(device)
        if dist.get_rank() == 0:
            result["profile_one_step"] = {"wall_ms": round(1e3 * (time.perf_counter() - start), 2), "kernels": kernels,
                                          "by_category_ms": profile_by_category(kernels)}
    if args.host_profile:
        _sync(device)
        profiled = host_profile_step(lambda: step(batches[0]), device)
        if dist.get_rank() == 0:
            result["host_profile_one_step"] = profiled
    if args.trace is not None:
        _sync(device)
        if dist.get_rank() == 0:
            args.trace.mkdir(parents=True, exist_ok=True)
            result["trace_one_step"] = trace_step(lambda: step(batches[0]), args.trace / f"trace-{name}.json.gz")
        else:
            step(batches[0])  # the collectives need every rank
    if how in ZERO_STAGE and hasattr(runner, "destroy"):
        runner.destroy()  # the engine's hooks and buffers, before the next variant builds its model
    return result  # the model and optimizer die here; the next variant's _free() returns their memory


def step_accounting(rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Where the profiled steps' GPU time went (``--profile``: :func:`benchmarks.common.profile_by_category` of each
    row) and the bound it sets for a kernelized step: the fastest profiled eager-mode kernelize row's GEMMs,
    attention, FSDP2 copies and AdamW as measured, plus the floor's memory-bound work at HBM bandwidth. None without
    a profiled eager row and such a kernelize row with a floor.

    Example:
        >>> row = lambda step, **ms: {"step_ms": step, "tokens_per_s": 1e3 / step, "profile_one_step":
        ...                           {"by_category_ms": ms}}
        >>> rows = {"eager": row(500.0, gemm=265.0, other=110.0),
        ...         "kernelize_before": {**row(430.0, gemm=288.0, fsdp2_copies=48.0), "kernelize": "before",
        ...                              "compiled": False, "floor": {"breakdown_ms": {"gemm": 263.0,
        ...                              "attention": 35.0, "memory_bound": 15.0}}}}
        >>> step_accounting(rows)["kernelized_bound_ms"], step_accounting(rows)["bound_vs_eager"]
        (351.0, 1.425)
    """
    profiled = {name: row for name, row in rows.items()
                if (row.get("profile_one_step") or {}).get("by_category_ms") and row.get("step_ms")}
    kernelized = [name for name, row in profiled.items()
                  if row.get("kernelize") and not row.get("compiled") and isinstance(row.get("floor"), dict)]
    if "eager" not in profiled or not kernelized:
        return None
    best = max(kernelized, key=lambda name: rows[name]["tokens_per_s"])
    by = {name: {**row["profile_one_step"]["by_category_ms"], "step_ms": round(row["step_ms"], 1)}
          for name, row in profiled.items()}
    floor_ms = rows[best]["floor"]["breakdown_ms"]
    bound = sum(by[best].get(part, 0.0) for part in ("gemm", "attention", "fsdp2_copies", "adamw"))
    bound = round(bound + floor_ms["memory_bound"], 1)
    accounting = {
        "what": ("GPU time per category in one profiled step on rank 0 (benchmarks.common.profile_by_category; NCCL "
                 "runs beside the rest) and the bound it sets: a kernelized step whose GEMMs, attention, FSDP2 "
                 f"copies and AdamW take what they took in {best}'s step and whose memory-bound work runs at the "
                 "floor's HBM bandwidth"),
        "kernelized": best, "by_variant_ms": by, "gemm_floor_ms": floor_ms["gemm"],
        "attention_floor_ms": floor_ms["attention"], "memory_bound_floor_ms": floor_ms["memory_bound"],
        "kernelized_bound_ms": bound, "bound_vs_eager": round(by["eager"]["step_ms"] / bound, 3)}
    if "liger" in by:
        accounting["bound_vs_liger"] = round(by["liger"]["step_ms"] / bound, 3)
    return accounting


def kernelize_config(base: str, modifiers: list[str]) -> dict[str, Any] | None:
    """The kernelize ``config`` of a variant: FP8 linears for the FP8 variants, the elementwise kinds switched
    off under ``+compilenative``, else None.

    Example:
        >>> kernelize_config("kernelize_compile", ["compilenative"])["kinds"]["rms_norm"]
        {'enabled': False}
    """
    config: dict[str, Any] = fp8_linear_config(FP8[base]) if base in FP8 else {"kinds": {}}
    if "compilenative" in modifiers:
        config["kinds"].update({kind: {"enabled": False} for kind in COMPILE_NATIVE_KINDS})
    return config if config["kinds"] else None


def cudagraph_record(device: torch.device) -> dict[str, Any]:
    """What Inductor's CUDA graph trees did in this process so far: graphs recorded, re-recordings (a static
    input, such as a parameter FSDP2 gathered into new memory, changed address) and skips (the graph ran without
    CUDA graphs; the log says why)."""
    from torch._dynamo.utils import counters

    record: dict[str, Any] = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    # Inductor keeps its graph trees in thread-local storage, one manager per device (absent on the CPU).
    if device.type != "cuda" or not torch._C._is_key_in_tls("tree_manager_containers"):
        return record
    manager = getattr(torch._C._get_obj_in_tls("tree_manager_containers").get(device.index), "tree_manager", None)
    if manager is None:
        return record
    try:
        # Private attributes of PyTorch 2.11's tree manager; itertools.count shows its next value only through
        # repr (count(N)).
        record["graphs_recorded"] = int(re.sub(r"\D", "", repr(manager.graph_counter)) or 0)
        record["rerecords"] = sum(sum(per.values()) for per in manager.num_rerecord.values())
    except (AttributeError, TypeError, ValueError) as exc:  # another PyTorch: the counters alone
        record["tree_manager"] = f"not read: {type(exc).__name__}: {exc}"
    return record


def localstep_ab(step: Any, opt: torch.optim.Optimizer, batches: torch.Tensor, device: torch.device, *, rounds: int,
                 steps: int) -> dict[str, Any]:
    """The same model and optimizer trained in alternating blocks of ``steps`` steps with AdamW stepping through
    DTensor dispatch and on the local shards (``kernels_core.optim``), the order flipped each round: tokens/s of
    each block and the median ratio local / DTensor. One process, one model: only the optimizer's path differs."""
    from kernels_core.optim import restore_step
    from kernels_core.optim import step_on_local_shards

    world = dist.get_world_size()
    tokens = world * batches.shape[1] * batches.shape[2] * steps
    done = 0  # steps so far: each block continues through the batches where the previous one stopped

    def block(mode: str) -> float:
        nonlocal done
        if mode == "local":
            step_on_local_shards(opt)
        else:
            restore_step(opt)
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step(batches[done % batches.shape[0]])
            done += 1
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return tokens / elapsed.item()

    speeds = alternating_rounds(("dtensor", "local"), rounds=rounds, block=block)
    restore_step(opt)
    ratios = [local / plain for local, plain in zip(speeds["local"], speeds["dtensor"], strict=True)]
    return {"rounds": rounds, "steps_per_block": steps,
            "tokens_per_s": {mode: [round(v) for v in values] for mode, values in speeds.items()},
            "median_tokens_per_s": {mode: round(statistics.median(values)) for mode, values in speeds.items()},
            "local_over_dtensor_each_round": [round(r, 4) for r in ratios],
            "local_over_dtensor_median": round(statistics.median(ratios), 4)}


def _floor_key(name: str, *, no_reshard: bool) -> tuple[str | None, bool] | None:
    """(FP8 recipe or None, reshard after forward) of an FSDP2 variant's floor; None for other wrappers."""
    base, modifiers = split_variant(name)
    if VARIANTS[base][0] != "fsdp":
        return None
    return FP8.get(base), not (no_reshard or "noreshard" in modifiers)


def measure_floors(args: argparse.Namespace, names: list[str], device: torch.device, *, batch: int,
                   seq: int) -> dict[tuple[str | None, bool], dict[str, Any]]:
    """The per-rank step floor of each FSDP2 variant's kind (see :func:`_floor_key`), communication included;
    every rank measures alike (the collectives need it)."""
    config = build_model(args.model, tiny=args.tiny, device=torch.device("meta"), layers=args.layers).config
    timer = floor.PartTimer(device)
    floors = {}
    for key in sorted({k for k in (_floor_key(n, no_reshard=args.no_reshard) for n in names) if k is not None},
                      key=str):
        recipe, reshard = key
        floors[key] = floor.step_floor(config, batch=batch, seq=seq, timer=timer, fp8=recipe,
                                       comm=timer.fsdp_comm_ms, layers_per_unit=args.layers_per_unit,
                                       reshard_after_forward=reshard)
    return floors


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: FSDP2's DTensor shard, ZeRO-3's partition, or the tensor itself."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    return param.to_local() if hasattr(param, "to_local") else param


def _merge_round(previous: dict[str, Any] | None, row: dict[str, Any]) -> dict[str, Any]:
    """One row per variant over all rounds: tokens/s is the median round, every round's value kept beside it."""
    if previous is None or "error" in previous or "error" in row:
        merged = dict(row if previous is None or "error" in row else previous)
        if "tokens_per_s" in merged:
            merged["tokens_per_s_each_round"] = [merged["tokens_per_s"]]
        return merged
    each = [*previous["tokens_per_s_each_round"], row["tokens_per_s"]]
    middle = sorted(each)[len(each) // 2]
    merged = dict(previous)
    merged.update(tokens_per_s=middle, step_ms=previous["step_ms"] * previous["tokens_per_s"] / middle,
                  tokens_per_s_each_round=each,
                  peak_GiB=max(previous["peak_GiB"] or 0.0, row["peak_GiB"] or 0.0) or None)
    if row["losses"] != previous["losses"]:
        merged.setdefault("losses_other_rounds", []).append(row["losses"])
    return merged


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def compare(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each kernelized variant against the eager run of the same wrapper."""
    ratios = {}
    for name, row in rows.items():
        compared = row["kernelize"] is not None or split_variant(name)[0] in LIGER
        base = rows.get(baseline(name, ran=rows)) if compared else None
        if base is None or "error" in row or "error" in base:
            continue
        ratios[name] = _versus(row, base)
        liger = rows.get("liger")
        if row["kernelize"] is not None and liger is not None and "error" not in liger and row["wrapper"] == "fsdp":
            ratios[f"{name}_vs_liger"] = _versus(row, liger)
    return ratios


def _versus(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {
        "vs": base["variant"],
        "tokens_per_s": _ratio(row["tokens_per_s"], base["tokens_per_s"]),
        "peak": _ratio(row["peak_GiB"], base["peak_GiB"]),
        "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(row["losses"], base["losses"], strict=True)),
    }


def _choice_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    ca, cb = a["report"]["choices"], b["report"]["choices"]
    keys = sorted(set(ca) | set(cb))
    return [f"{key}: {ca.get(key)} vs {cb.get(key)}" for key in keys if ca.get(key) != cb.get(key)]


def _pairs(rows: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(kernelize before, kernelize after) pairs of variants in ``rows`` with the same wrapper and modifiers."""
    prefixes = ("", "ddp_", *(f"ds_zero{stage}_" for stage in ZERO_STAGE.values()))
    orders = [("kernelize_compile", "kernelize_compile_after"),
              *((f"{p}kernelize_before", f"{p}kernelize_after") for p in prefixes)]
    pairs = []
    for name in rows:
        base, modifiers = split_variant(name)
        for before, after in orders:
            other = "+".join([after, *modifiers])
            if base == before and other in rows:
                pairs.append((name, other))
    return pairs


def targets(rows: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]], *,
            world: int = 2) -> list[dict[str, Any]]:
    out = []

    def add(name: str, value: object, target: str, met: bool) -> None:
        out.append({"name": name, "value": value, "target": target, "met": bool(met)})

    wanted = TARGET_SPEEDUP_ONE_GPU if world == 1 else TARGET_SPEEDUP
    for name in rows:
        if split_variant(name)[0] not in ("kernelize_before", "kernelize_after"):
            continue
        r = ratios.get(name, {})
        speed, peak, loss = r.get("tokens_per_s"), r.get("peak"), r.get("max_rel_loss_diff")
        add(f"{name} tokens/s vs {r.get('vs', 'eager')}", speed, f">= {wanted}", speed is not None and speed >= wanted)
        add(f"{name} peak vs eager", peak, f"<= {TARGET_PEAK}", peak is not None and peak <= TARGET_PEAK)
        add(f"{name} max relative loss difference vs eager", loss, f"<= {TARGET_LOSS_REL}",
            loss is not None and loss <= TARGET_LOSS_REL)
    if "kernelize_compile" in ratios:
        r = ratios["kernelize_compile"]
        add("kernelize_compile max relative loss difference vs compile", r["max_rel_loss_diff"],
            f"<= {TARGET_LOSS_REL}", r["max_rel_loss_diff"] <= TARGET_LOSS_REL)
    for name in rows:
        if split_variant(name)[0] not in FP8:
            continue
        r = ratios.get(name, {})
        speed, loss, vs = r.get("tokens_per_s"), r.get("max_rel_loss_diff"), baseline(name, ran=rows)
        add(f"{name} tokens/s vs {vs}", speed, f">= {TARGET_FP8_SPEEDUP}",
            speed is not None and speed >= TARGET_FP8_SPEEDUP)
        add(f"{name} max relative loss difference vs {vs}", loss, f"<= {TARGET_FP8_LOSS_REL}",
            loss is not None and loss <= TARGET_FP8_LOSS_REL)
    for stage in ZERO_STAGE.values():
        for order in ("before", "after"):
            name = f"ds_zero{stage}_kernelize_{order}"
            if name not in rows:
                continue
            r = ratios.get(name, {})
            speed, peak, loss = r.get("tokens_per_s"), r.get("peak"), r.get("max_rel_loss_diff")
            add(f"{name} tokens/s vs ds_zero{stage}", speed, f">= {TARGET_ZERO_SPEEDUP}",
                speed is not None and speed >= TARGET_ZERO_SPEEDUP)
            add(f"{name} peak vs ds_zero{stage}", peak, "<= 1.0", peak is not None and peak <= 1.0)
            add(f"{name} max relative loss difference vs ds_zero{stage}", loss, f"<= {TARGET_LOSS_REL}",
                loss is not None and loss <= TARGET_LOSS_REL)
    for name, row in rows.items():
        if "lm_head_adapter_trained" in row:
            trained = row["lm_head_adapter_trained"]
            add(f"{name} lm_head LoRA adapter trained", trained, "True", trained)
    for first, second in _pairs(rows):  # a pair is compared only when both orders ran (same modifiers)
        before, after = rows[first], rows[second]
        ok = "error" not in before and "error" not in after
        ratio = _ratio(before["tokens_per_s"], after["tokens_per_s"]) if ok else None
        add(f"{first} / {second} tokens/s", ratio, f"within {TARGET_BEFORE_AFTER:.0%}",
            ratio is not None and abs(ratio - 1) <= TARGET_BEFORE_AFTER)
        diff = _choice_diff(before, after) if ok else ["variant missing or failed"]
        add(f"{first} / {second} identical kernel choices", diff[:20] or "identical", "identical", not diff)
    return out


def environment_record(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = environment() if device.type == "cuda" else {"device": "cpu", "torch": torch.__version__}
    env.update(
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
        nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        nvls_env={k: os.environ.get(k) for k in
                  ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")},
    )
    return env


def _fmt(value: float | None, spec: str) -> str:
    width = int(re.match(r"\d*", spec).group() or 0)
    return "-".rjust(width) if value is None else format(value, spec)


def print_table(rows: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]], checks: list[dict]) -> None:
    print(f"{'variant':33} {'tok/s':>9} {'x base':>7} {'peak GiB':>9} {'x base':>7} {'loss first':>10} "
          f"{'loss last':>10} {'dloss rel':>9}  kernels applied / declined")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:33} ERROR {row['error'][:150]}")
            continue
        r = ratios.get(name, {})
        report = row.get("report")
        kernels = "-" if report is None else (
            f"{sum(sum(c.values()) for c in report['kernels'].values())} / {report['declined_total']}")
        print(f"{name:33} {row['tokens_per_s']:9.0f} {_fmt(r.get('tokens_per_s'), '7.3f')} "
              f"{_fmt(row['peak_GiB'], '9.2f')} {_fmt(r.get('peak'), '7.3f')} {row['losses'][0]:10.5f} "
              f"{row['losses'][-1]:10.5f} {_fmt(r.get('max_rel_loss_diff'), '9.1e')}  {kernels}")
    for name, row in rows.items():
        if not row.get("report"):
            continue
        by_kind = row["report"]["kernels"]
        print(f"  {name}: " + "; ".join(f"{k} {dict(v)}" for k, v in sorted(by_kind.items())))
        for d in rows[name]["report"]["declined"]:
            print(f"    declined {d['count']}x {d['kind']}: {d['reason'][:160]}")
    for check in checks:
        print(f"[{'ok' if check['met'] else 'MISSED'}] {check['name']}: {check['value']} (target {check['target']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{DEFAULT_MODEL} or a models_bench.py shape")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated subset of {list(VARIANTS)}, each FSDP2 one optionally with "
                             f"+modifiers: prefetch<N>, {', '.join(MODIFIERS)} (see the module's docstring)")
    parser.add_argument("--nprocs", help="comma-separated GPU counts (e.g. 1,2,4): run the job under torchrun at "
                                         "each and write one file with every count and the scaling efficiency")
    parser.add_argument("--layers", type=int,
                        help="decoder layers (default: the shape's own; llama-3.1-8b-4l --layers 32 is the "
                             "Llama-3.1-8B shape at full depth)")
    parser.add_argument("--combine", metavar="N=FILE,...",
                        help="no run: write --out (scaling, chart) from result files of separate jobs at N GPUs")
    parser.add_argument("--steps", type=int, default=17, help="timed steps (with the warm-up: 20 losses compared)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (Triton compiles, AdamW states)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 1024-token-vocabulary model, batch 2 x 128")
    parser.add_argument("--batch", type=int, help="sequences per rank (default 4, --tiny 2)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 2048, --tiny 128)")
    parser.add_argument("--no-reshard", action="store_true",
                        help="decoder layers keep their gathered parameters from forward to backward "
                             "(reshard_after_forward=False: no all-gather in backward, more memory)")
    parser.add_argument("--profile", action="store_true", help="add rank 0's GPU time per kernel of one more step")
    parser.add_argument("--layers-per-unit", type=int, default=1,
                        help="decoder layers per FSDP2 unit (default 1: fully_shard on each layer)")
    parser.add_argument("--host-profile", action="store_true",
                        help="add rank 0's host (CPU) time of one more step: the Python functions taking the most "
                             "time under cProfile, and how long the step keeps the host busy before the GPU finishes")
    parser.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                        help="AdamW implementation on CUDA (fused: one kernel per parameter group; foreach: "
                             "torch's multi-tensor path, which dispatches per DTensor under FSDP2)")
    parser.add_argument("--peft", choices=sorted(PEFT_TARGETS),
                        help="train PEFT LoRA adapters (r 16, alpha 32, dropout 0.05) in every variant: on every "
                             "decoder linear, on those and lm_head, or QLoRA (bitsandbytes 4-bit nf4 base, CUDA)")
    parser.add_argument("--localstep-ab", type=int, metavar="ROUNDS",
                        help="after each FSDP2 variant's timed steps, ROUNDS rounds of --steps steps alternating "
                             "AdamW through DTensor dispatch and on the local shards (kernels_core.optim), same "
                             "model and optimizer, order flipped each round: their median tokens/s and ratio")
    parser.add_argument("--trace", type=pathlib.Path,
                        help="folder for a Chrome trace of one more step of each variant on rank 0 (host threads and "
                             "GPU), with its summary in the row: GPU busy and idle time, blocking runtime calls")
    parser.add_argument("--print-report", action="store_true", help="print each kernelize report table (rank 0)")
    parser.add_argument("--no-floor", action="store_true", help="no floor accounting (benchmarks.cuda.floor)")
    parser.add_argument("--gc", choices=("default", "freeze"), default="default",
                        help="Python's garbage collector over the timed steps: as it is, or gc.freeze() after the "
                             "warm-up (no collection walks what the model and its compiled graphs keep alive)")
    parser.add_argument("--repeats", "--rounds", type=int, default=1,
                        help="run the whole variant list this many times, interleaved, and report each variant's "
                             "median tokens/s (a shared machine's drift then hits every variant alike)")
    args = parser.parse_args()
    problems = list(filter(None, map(variant_problem, args.variants.split(","))))
    if problems:
        parser.error("; ".join(problems))
    if args.model != DEFAULT_MODEL and args.model not in models_bench.MODELS:
        parser.error(f"unknown model {args.model!r}; choose from {[DEFAULT_MODEL, *models_bench.MODELS]}")
    ran = args.variants.split(",")
    kernelized = {name: baseline(name, ran=ran) for name in {*VARIANTS, *ran}
                  if VARIANTS[split_variant(name)[0]][1] is not None}
    if args.combine:
        parts = dict(item.split("=", 1) for item in args.combine.split(","))
        combine({int(n): pathlib.Path(path) for n, path in parts.items()}, args.out, baseline=kernelized.get)
        return
    if args.nprocs:
        sys.exit(scale(args, [int(n) for n in args.nprocs.split(",")], module="benchmarks.cuda.distributed_bench",
                       baseline=kernelized.get))
    if args.device == "cpu":
        # DeepSpeed picks its accelerator when first imported; without a GPU it must be told to use the CPU's.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    device = setup(args.device)
    rank = dist.get_rank()
    if device.type == "cuda":
        # The norms' C++ autograd nodes build in the background on a new machine (about a minute): variants timed
        # before they are ready would run the Python nodes, and an order of variants would look like a speed-up.
        extension = settle_cpp_extension()
    else:
        extension = None
    names = args.variants.split(",")
    batch = args.batch or (2 if args.tiny else 4)
    seq = args.seq or (128 if args.tiny else 2048)
    vocab = vocab_size(args.model, tiny=args.tiny)
    # Different data per rank, the same per variant: one generator seeded by the rank, drawn once for all variants.
    generator = torch.Generator(device=device).manual_seed(1000 + rank)
    batches = torch.randint(0, vocab, (args.warmup + args.steps, batch, seq), device=device, generator=generator)

    quantized = ", base 4-bit nf4 by bitsandbytes, bf16 quant storage" if args.peft == "qlora" else ""
    peft = "" if args.peft is None else (
        f"PEFT {args.peft} (r 16, alpha 32, dropout 0.05, targets {PEFT_TARGETS[args.peft]}{quantized}) "
        "in every variant; ")
    wrappers = {VARIANTS[split_variant(name)[0]][0] for name in names}
    stages = sorted(ZERO_STAGE[how] for how in wrappers & ZERO_STAGE.keys())
    zero = "" if not stages else (
        f"DeepSpeed ZeRO-{'/'.join(map(str, stages))} variants: deepspeed.initialize with AdamW as the client "
        f"optimizer, bf16, micro-batch {batch}; ")
    fp8 = "" if not FP8.keys() & set(names) else (
        "FP8 variants: kernelize_compile with [kinds.linear] prefer cuda.linear.float8_<recipe>; ")
    payload: dict[str, Any] = {
        "environment": environment_record(device),
        "model": args.model,
        "config": (f"{args.model} shape{f' at {args.layers} layers' if args.layers else ''}"
                   f"{' (--tiny: ' + str(TINY) + ')' if args.tiny else ''}, bf16 parameters, sdpa; "
                   f"FSDP2 fully_shard per {args.layers_per_unit} decoder layer(s) then root, no mixed-precision "
                   "policy / DDP; "
                   "compile variants: torch.compile per decoder layer before fully_shard; "
                   f"{fp8}{zero}{peft}"
                   f"AdamW({args.optimizer} on CUDA, lr 1e-5); batch {batch} x {seq} per rank; "
                   "seeds: model 0, data 1000 + rank"
                   f"{'; gc.freeze() after each variant warm-up' if args.gc == 'freeze' else ''}"),
        "steps_timed": args.steps,
        "steps_warmup": args.warmup,
        "losses_are": "mean over ranks, every step (warm-up first)",
        "cpp_autograd_extension": extension,
        "layers": args.layers,
        "peft": args.peft,
    }
    floors: dict[tuple[str | None, bool], dict[str, Any]] = {}
    if args.no_floor or args.peft is not None:
        payload["floor"] = "not measured (--no-floor)" if args.no_floor else "not modelled for PEFT (frozen base)"
    else:
        floors = measure_floors(args, names, device, batch=batch, seq=seq)
    rows: dict[str, dict[str, Any]] = {}
    failed = False
    for repeat in range(args.repeats):
        for name in names:
            if rank == 0:
                print(f"== {name} ({time.strftime('%X')}, round {repeat + 1}/{args.repeats})", flush=True)
            try:
                # A variant may patch transformers' modeling modules process-wide (Liger does): the next variant
                # builds its model from the modules as they were.
                with modeling_globals_kept():
                    row = run_variant(name, args, device, batches)
            except Exception as exc:  # noqa: BLE001 - a crashing variant is a result to report; others still run
                how, order = VARIANTS[split_variant(name)[0]]
                row = {"variant": name, "wrapper": how, "kernelize": order, "peft": args.peft,
                       "error": f"{type(exc).__name__}: {exc}"[:3000], "traceback": traceback.format_exc()[-6000:]}
                print(f"[rank {rank}] {name} failed:\n{row['traceback']}", file=sys.stderr, flush=True)
                failed = True
                _free(device)
            rows[name] = _merge_round(rows.get(name), row)
            key = _floor_key(name, no_reshard=args.no_reshard)
            floor.attach(rows[name], floors.get(key) if key else None)
            if rank == 0:
                ratios = compare(rows)
                write_json(args.out, {**payload, "variants": rows, "ratios_vs_eager": ratios,
                                      "targets": targets(rows, ratios, world=dist.get_world_size())})
            dist.barrier()
    if rank == 0:
        ratios = compare(rows)
        checks = targets(rows, ratios, world=dist.get_world_size())
        accounting = step_accounting(rows)
        write_json(args.out, {**payload, "variants": rows, "ratios_vs_eager": ratios, "targets": checks,
                              "all_targets_met": all(c["met"] for c in checks),
                              **({"step_accounting": accounting} if accounting else {})})
        print_table(rows, ratios, checks)
        print(f"wrote {args.out}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
