"""kernelize before vs after wrapping for FSDP2 or DDP: same kernels, same losses, and the same as eager.

    torchrun --standalone --nproc_per_node 2 train_worker.py --wrap fsdp            # 2 GPUs, NCCL
    torchrun --standalone --nproc_per_node 2 train_worker.py --wrap ddp --device cpu  # gloo, no GPU

For each dtype, three runs from the same seeds: eager, ``kernelize(mode=TRAINING)`` then wrap, wrap then
``kernelize``. FSDP2 is ``fully_shard`` on each decoder layer, then on the root. Each run trains a tiny Qwen3
for a few AdamW steps on per-rank data. Checks: both reports have no probe that raised and every expected kind
applied on every module it matched; both orders chose the same kernel for every (module, kind); their losses
(mean over ranks) agree closely (the same kernels on the same tensors) and agree with eager within the dtype's
tolerance. Exits 1 on the first failure, printing the report.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from _shared import DTYPES
from _shared import check
from _shared import check_report
from _shared import choice_differences
from _shared import init_distributed
from _shared import log
from _shared import rel
from _shared import tiny_model
from _shared import wrap


# Relative loss tolerances: (before vs after, kernelized vs eager). The two orders run the same kernels on the same
# unsharded tensors, so they differ by run-to-run noise at most (SDPA's memory-efficient backward accumulates with
# atomics on GPU); against eager, kernels compute in float32 and fuse differently (~1e-5 in float32; bf16 rounding
# of activations in bfloat16), over 3 AdamW steps at lr 1e-3 on one repeated batch.
TOLERANCES = {"float32": (1e-4, 1e-3), "bfloat16": (1e-2, 2e-2)}




def train(order: str | None, args: argparse.Namespace, dtype_name: str, device: torch.device) -> dict[str, Any]:
    import kernels_core

    model = tiny_model(args.layers, dtype=DTYPES[dtype_name], device=str(device))
    model.train()
    if order == "before":
        kernels_core.kernelize(model, mode=kernels_core.Mode.TRAINING)
    runner = wrap(model, args.wrap, device)
    if order == "after":
        kernels_core.kernelize(runner, mode=kernels_core.Mode.TRAINING)
    # The report sits on the object kernelize was given: the bare model, or the DDP wrapper around it.
    report = kernels_core.get_report(model if order == "before" else runner) if order else None
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-3)
    # Per-rank data, the same in every run; one batch repeated, so that the loss falls and every step's update
    # shows in the next loss instead of drowning in batch-to-batch noise.
    generator = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    ids = torch.randint(0, 1024, (2, 64), device=device, generator=generator)
    losses = []
    for _ in range(args.steps):
        loss = runner(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    mean = torch.stack(losses)
    dist.all_reduce(mean)  # SUM (gloo has no AVG)
    return {"losses": (mean / dist.get_world_size()).tolist(), "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wrap", choices=("fsdp", "ddp"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    device = init_distributed(args.device)
    backend = device.type
    for dtype_name in args.dtypes.split(","):
        runs = {order or "eager": train(order, args, dtype_name, device) for order in (None, "before", "after")}
        before, after = runs["before"], runs["after"]
        what = f"{args.wrap} {dtype_name}"
        check_report(before["report"], backend, what=f"{what} kernelize before wrapping")
        check_report(after["report"], backend, what=f"{what} kernelize after wrapping")
        differ = choice_differences(before["report"], after["report"])
        check(not differ, f"{what}: kernel choices depend on the order (before / after): {differ}", after["report"])
        pair_tol, eager_tol = TOLERANCES[dtype_name]
        eager = runs["eager"]["losses"]
        log(f"{what}: losses eager {eager} / before {before['losses']} / after {after['losses']}")
        for step, (e, b, a) in enumerate(zip(eager, before["losses"], after["losses"], strict=True)):
            check(rel(a, b) <= pair_tol, f"{what} step {step}: before {b} vs after {a} (tolerance {pair_tol})")
            check(rel(b, e) <= eager_tol, f"{what} step {step}: kernelized {b} vs eager {e} (tolerance {eager_tol})")
        log(f"{what}: OK; {after['report'].summary()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
