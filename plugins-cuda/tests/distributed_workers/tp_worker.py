"""kernelize on a transformers tensor-parallel model (``from_pretrained(..., tp_plan="auto")``) under torchrun.

    torchrun --standalone --nproc_per_node 2 tp_worker.py                  # 2 GPUs, NCCL
    torchrun --standalone --nproc_per_node 2 tp_worker.py --device cpu     # gloo

Rank 0 saves a tiny Qwen3ForCausalLM; every rank loads it twice with the model's own TP plan (attention and MLP
projections split column- and row-wise over the ranks, parameters as DTensors): once eager, once followed by
``kernelize(mode=TRAINING)``. Both run one forward and backward on the same batch (identical on every rank, as
tensor parallelism requires). Checks: the model really is sharded; kernelize does not raise; every matched module
in the report got a kernel or says why not; loss and every parameter's local gradient match eager's. Which kernels
were used and which were declined (and why) is printed: under TP, kernels that handle DTensors or local shards
may be used, the others must be declined with a reason, never crash the step.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from _shared import DTYPES
from _shared import check
from _shared import fail
from _shared import finish
from _shared import init_distributed
from _shared import local
from _shared import log
from _shared import rel
from _shared import rel_norm
from _shared import shared_checkpoint


# (loss, per-parameter gradient) relative tolerances, as in the single-GPU end-to-end tests (test_e2e_gpu.py).
TOLERANCES = {"float32": (1e-4, 2e-2), "bfloat16": (2e-2, 1e-1)}


def load(path: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    # tp_plan="auto": the model's own base_model_tp_plan. (Newer transformers prefer
    # distributed_config=DistributedConfig(tp_plan=...) and warn; the GPU machine's 5.17 takes tp_plan.)
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
    model.train()
    return model


def step(model: Any, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = model.named_parameters()
    grads = {name: local(p.grad).detach().float().clone() for name, p in params if p.grad is not None}
    return local(loss).item(), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    import kernels_core

    device = init_distributed(args.device)
    world = dist.get_world_size()
    dtype = DTYPES[args.dtype]
    path = shared_checkpoint(args.layers, prefix="kernels-tp-")
    ids = torch.randint(3, 1024, (2, 64), generator=torch.Generator().manual_seed(11)).to(device)
    eager_model = load(path, dtype)
    shard = local(eager_model.model.layers[0].mlp.gate_proj.weight)
    intermediate = eager_model.config.intermediate_size
    check(shard.shape[0] == intermediate // world,
          f"gate_proj not sharded by tp_plan='auto': local shape {tuple(shard.shape)}, intermediate {intermediate}")
    eager_loss, eager_grads = step(eager_model, ids)
    del eager_model

    model = load(path, dtype)
    try:
        kernels_core.kernelize(model, mode=kernels_core.Mode.TRAINING)
    except Exception as exc:  # noqa: BLE001 - the failure to report, with its type
        fail(f"kernelize raised on the TP model: {type(exc).__name__}: {exc}")
    report = kernels_core.get_report(model)
    check(report is not None, "get_report returned None after kernelize")
    log(report.table())
    silent = [f"{e.module} ({e.kind})" for e in report.entries if not e.applied and not (e.reason or "").strip()]
    check(not silent, f"declined without a reason: {silent}", report)
    probes = [f"{e.module} ({e.kind}): {e.reason}" for e in report.entries
              if "probe forward raised" in (e.reason or "")]
    if probes:
        log(f"NOTE: {len(probes)} modules declined because their probe raised (a reason, but not a deliberate "
            f"decline): {probes[:4]}")
    try:
        loss, grads = step(model, ids)
    except Exception as exc:  # noqa: BLE001
        fail(f"the kernelized TP model's training step raised {type(exc).__name__}: {exc}", report)
    loss_tol, grad_tol = TOLERANCES[args.dtype]
    log(f"tp {args.dtype}: loss eager {eager_loss} / kernelized {loss}")
    check(rel(loss, eager_loss) <= loss_tol, f"loss {loss} vs eager {eager_loss} (tolerance {loss_tol})", report)
    check(set(grads) == set(eager_grads), f"gradients of different parameters: {set(grads) ^ set(eager_grads)}")
    errors = {name: rel_norm(grads[name], eager_grads[name]) for name in grads}
    worst = max(errors, key=errors.get)
    bad = {name: f"{error:.2e}" for name, error in errors.items() if error > grad_tol}
    check(not bad, f"gradients differ from eager's by more than {grad_tol} (relative norm) on {bad}", report)
    log(f"tp {args.dtype}: OK; worst gradient {worst} {errors[worst]:.2e}; {report.summary()}")
    finish(path)


if __name__ == "__main__":
    main()
