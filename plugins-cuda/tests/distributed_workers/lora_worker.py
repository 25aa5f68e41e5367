"""PEFT LoRA (every linear layer and lm_head) under FSDP2 with kernels-core: the losses and adapter gradients of
plain PEFT + FSDP2, whichever order kernelize, ``get_peft_model`` and ``fully_shard`` run in.

    torchrun --standalone --nproc_per_node 2 lora_worker.py                 # 2 GPUs, NCCL
    torchrun --standalone --nproc_per_node 2 lora_worker.py --device cpu    # gloo, no GPU

For each dtype, four runs from the same seeds: plain (``get_peft_model``, then ``fully_shard`` on every decoder
layer and on the PEFT model), and kernelize on the bare model first (``before``), between ``get_peft_model`` and
``fully_shard`` (``peft_then``) or last (``after``). LoRA weights start random (``init_lora_weights=False``) so that
every adapter matrix gets a gradient. Checks: every expected kind applied (the fused loss included: LoRA on
lm_head is folded into it), the fused loss ran (no logits returned), every step's loss (mean over ranks) within
the dtype's tolerance of plain's, and each rank's shard of every LoRA gradient of the first step within the same
relative norm error (float32) or no further from the plain float32 run's than twice plain bfloat16's plus 2^-7
(bfloat16), none missing. Exits 1 on the first failure, printing the report.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch
import torch.distributed as dist
from _shared import DTYPES
from _shared import check
from _shared import check_report
from _shared import init_distributed
from _shared import local
from _shared import log
from _shared import rel
from _shared import rel_norm
from _shared import tiny_model


# Relative, per step and per gradient. float32: kernels differ from eager by summation order (~1e-6); bfloat16:
# activations round at 2^-8 and the kernels keep some intermediates in float32 where eager rounds them.
TOLERANCES = {"float32": 1e-3, "bfloat16": 3e-2}
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=[*LINEARS, "lm_head"], init_lora_weights=False)
    torch.manual_seed(7)  # the same adapter weights in every run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, config)


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def train(order: str | None, args: argparse.Namespace, dtype_name: str, device: torch.device) -> dict[str, Any]:
    import kernels_core

    mode = kernels_core.Mode.TRAINING
    model = tiny_model(args.layers, dtype=DTYPES[dtype_name], device=str(device))
    kernelized = model
    if order == "before":
        kernels_core.kernelize(model, mode=mode)
    model = _peft(model)
    if order == "peft_then":
        kernels_core.kernelize(kernelized := model, mode=mode)
    _shard(model)
    if order == "after":
        kernels_core.kernelize(kernelized := model, mode=mode)
    model.train()
    report = kernels_core.get_report(kernelized) if order else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    ids = torch.randint(3, 1024, (2, 64), device=device, generator=generator)
    losses, grads, fused = [], {}, True
    for step in range(args.steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        fused = fused and out.logits is None
        if step == 0:
            grads = {n: None if p.grad is None else local(p.grad).detach().float().clone()
                     for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float())
    mean = torch.stack(losses)
    dist.all_reduce(mean)  # SUM (gloo has no AVG)
    return {"losses": (mean / dist.get_world_size()).tolist(), "grads": grads, "report": report, "fused": fused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    device = init_distributed(args.device)
    plains: dict[str, dict] = {}  # plain runs by dtype; bfloat16 gradients are measured against float32's
    for dtype_name in args.dtypes.split(","):
        plain = plains[dtype_name] = train(None, args, dtype_name, device)
        if "float32" not in plains:
            plains["float32"] = train(None, args, "float32", device)
        tolerance = TOLERANCES[dtype_name]
        for order in ("before", "peft_then", "after"):
            what = f"fsdp2 lora {dtype_name} kernelize {order}"
            run = train(order, args, dtype_name, device)
            check_report(run["report"], device.type, what=what)
            check(run["fused"], f"{what}: the fused loss did not run (logits returned)", run["report"])
            for step, (got, expected) in enumerate(zip(run["losses"], plain["losses"], strict=True)):
                check(rel(got, expected) <= tolerance, f"{what} step {step}: loss {got} vs plain {expected} "
                                                       f"(tolerance {tolerance})", run["report"])
            check(run["grads"].keys() == plain["grads"].keys(), f"{what}: different trainable parameters")
            head = [n for n in plain["grads"] if "lm_head.lora_" in n]
            check(len(head) == 2, f"{what}: lm_head has no LoRA adapter ({head})")
            for name, expected in plain["grads"].items():
                got = run["grads"][name]
                check(got is not None, f"{what}: {name} got no gradient (bypassed by a kernel)", run["report"])
                if expected is None or not expected.numel():
                    continue
                if dtype_name == "float32":
                    err = rel_norm(got, expected)
                    check(err <= tolerance, f"{what}: {name} gradient differs by {err:.2e} relative", run["report"])
                    continue
                # Two bfloat16 runs differ from each other by up to the sum of their own errors, and the first
                # layers' LoRA gradients sum the rounding of every layer above them: measure both against the
                # float32 run instead. The kernelized error may be up to twice plain's (other summation orders
                # and float32 intermediates round elsewhere), plus 2^-7, a couple of bfloat16 ulps.
                truth = plains["float32"]["grads"][name]
                err, base = rel_norm(got, truth), rel_norm(expected, truth)
                check(err <= 2 * base + 2**-7, f"{what}: {name} gradient is {err:.2e} from float32's (plain "
                                                f"bfloat16: {base:.2e})", run["report"])
            log(f"{what}: OK; losses {run['losses']} vs plain {plain['losses']}; {run['report'].summary()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
