"""kernelize on a 2-D parallel model: FSDP2 over one mesh dimension, transformers tensor parallelism over the other.

    torchrun --standalone --nproc_per_node 4 tp_fsdp_worker.py                     # 4 GPUs, NCCL
    torchrun --standalone --nproc_per_node 4 tp_fsdp_worker.py --device cpu        # gloo
    torchrun --standalone --nproc_per_node 4 tp_fsdp_worker.py --dtype float32 --dtype bfloat16 --tp 2

The ranks form a ``(dp, tp)`` device mesh (``world // tp`` by ``tp``). Rank 0 saves a tiny Qwen3ForCausalLM;
every rank loads it with the model's own TP plan over the ``tp`` dimension, and FSDP2 shards it over the ``dp``
dimension (``fully_shard`` on each decoder layer, then the root). transformers offers two ways to get there, and
``--load auto`` takes the first one the installed version supports:

- ``mesh``: ``from_pretrained(path, tp_plan="auto", device_mesh=mesh)`` applies TP on the mesh's ``tp``
  dimension (transformers 5.17 does); this script then calls ``fully_shard(..., mesh=mesh["dp"])``. Runs: eager,
  ``kernelize`` after the TP load and before ``fully_shard``, and ``kernelize`` after ``fully_shard``.
- ``native``: ``from_pretrained(path, distributed_config=DistributedConfig(tp_size=tp, fsdp_size=world // tp))``
  applies both TP and FSDP2 itself (transformers 5.23, which builds its own mesh and ignores ``device_mesh``). Runs:
  eager and ``kernelize`` on the loaded model (after ``fully_shard``); there is no point between TP and FSDP2
  where a caller could kernelize.

Each run trains for a few AdamW steps from the same weights on per-``dp``-rank data (identical within a TP
group, as TP requires; different across ``dp`` ranks). Checks: the parameters really are sharded over both mesh
dimensions; kernelize does not raise; no probe raised; every matched module got a kernel or says why not; the
kernels that take this rank's local activations (decoder-layer and final RMSNorm, gated MLP) are applied; the
losses (mean over all ranks) match the eager 2-D run's at every step, and the two kernelize orders match each
other and choose the same kernels. Which kernels were used and which were declined (and why) is printed. Exits 1
on the first failure, printing the report.
"""

from __future__ import annotations

import argparse
import re
import warnings
from typing import Any

import torch
import torch.distributed as dist
from _shared import DTYPES
from _shared import check
from _shared import choice_differences
from _shared import fail
from _shared import finish
from _shared import init_distributed
from _shared import local
from _shared import log
from _shared import rel
from _shared import shared_checkpoint
from _shared import wrap


# Relative loss tolerances per dtype: (kernelize before vs after, kernelized vs eager 2-D), at every one of the
# steps. Both orders run the same kernels on the same shards, so they differ by run-to-run noise at most (atomics
# in SDPA's backward on GPU), as in train_worker.py. Against eager in float32: on CPU the portable kernels do
# eager's arithmetic and the losses agree exactly; on GPU they reduce in another order (~1e-6 relative per op),
# and AdamW's first updates at lr 1e-3 are about lr * sign(gradient), which such differences flip only where a
# gradient is ~0 (plugins-cuda's FSDP2 and DDP benchmarks stay within 1.6e-5 of eager over 23 steps on an H200).
# For scale: a kernel 1% off (the gated MLP's output) moves the loss of this model by 3e-4 after one step.
# In bfloat16 the activations are rounded to 8 bits at different points: 2e-2, as the single-GPU end-to-end
# tests and train_worker.py.
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (1e-2, 2e-2)}
# Kinds whose kernels see only this rank's local activations under TP (norms over the replicated hidden state,
# the MLP over its column shards) and so must be applied on every module they matched that TP left alone. Others
# (the fused loss over a vocabulary-sharded lm_head, the per-head q/k norms behind TP's own forward hooks) may be
# declined, with a reason.
LOCAL_KINDS = ("rms_norm", "silu_gated_mlp")


def load(path: str, dtype: torch.dtype, how: str, mesh: Any, tp: int) -> Any:
    """The tiny Qwen3, TP over ``mesh["tp"]``; with ``how == "native"`` transformers also applies FSDP2."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        # 5.17 takes tp_plan= and device_mesh= and warns that tp_plan moves into DistributedConfig.
        warnings.simplefilter("ignore", FutureWarning)
        if how == "mesh":
            model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=mesh, dtype=dtype)
        else:
            from transformers.distributed import DistributedConfig

            config = DistributedConfig(tp_size=tp, fsdp_size=dist.get_world_size() // tp)
            model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=dtype)
    model.train()
    return model


def mesh_names(param: torch.Tensor) -> tuple[str, ...]:
    mesh = getattr(param, "device_mesh", None)
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def tp_ranks(model: Any) -> int:
    """How many ranks tensor parallelism split the model over (1 if it did not)."""
    weight = model.model.layers[0].mlp.gate_proj.weight
    mesh = getattr(weight, "device_mesh", None)
    return mesh.size(mesh.mesh_dim_names.index("tp")) if mesh is not None and "tp" in mesh_names(weight) else 1


def tp_honours_mesh(path: str, dtype: torch.dtype, mesh: Any, tp: int) -> bool:
    """Whether ``from_pretrained(tp_plan="auto", device_mesh=mesh)`` shards over ``mesh["tp"]`` (tp ranks), rather
    than ignoring the mesh and sharding over the whole world (or refusing the argument)."""
    try:
        model = load(path, dtype, "mesh", mesh, tp)
    except Exception as exc:  # noqa: BLE001 - any refusal means: not this way
        log(f"tp_plan='auto', device_mesh=(dp, tp) raised {type(exc).__name__}: {exc}")
        return False
    log(f"tp_plan='auto', device_mesh=(dp, tp): tensor parallel over {tp_ranks(model)} ranks")
    return tp_ranks(model) == tp


def check_2d(model: Any, what: str, tp: int) -> None:
    """Every TP-sharded parameter is also FSDP-sharded: a DTensor on a 2-D mesh, sharded on both dimensions, with
    1/world of the elements here; the rest (norms) FSDP-sharded over the data-parallel dimension."""
    world = dist.get_world_size()
    two_d, one_d, other = [], [], []
    for name, param in model.named_parameters():
        placements = getattr(param, "placements", None)
        if placements is None:
            other.append(f"{name}: plain {type(param).__name__}")
            continue
        # Shard, or the _StridedShard FSDP2 puts on the dp dimension of a dimension TP already splits.
        shards = [getattr(p, "dim", None) is not None for p in placements]
        if len(placements) == 2 and all(shards) and "tp" in mesh_names(param):
            check(local(param).numel() * world == param.numel(),
                  f"{what}: {name} holds {local(param).numel()} of {param.numel()} elements on a {world}-rank mesh")
            two_d.append(name)
        elif len(placements) == 1 and shards[0] and "tp" not in mesh_names(param):
            one_d.append(name)
        else:
            other.append(f"{name}: {placements} on {mesh_names(param)}")
    check(not other, f"{what}: parameters not sharded over (dp, tp) or dp: {other}")
    projections = [n for n in two_d if n.endswith("proj.weight")]
    layers = len(model.model.layers)
    check(len(projections) == 7 * layers,
          f"{what}: {len(projections)} of {7 * layers} attention/MLP projections sharded over both dimensions "
          f"(tp {tp}): {two_d}")
    gate = model.model.layers[0].mlp.gate_proj.weight
    log(f"{what}: {len(two_d)} parameters sharded over (dp, tp), {len(one_d)} over dp alone; e.g. gate_proj "
        f"{gate.placements} on {mesh_names(gate)}")


def check_kernels(report: Any, what: str) -> None:
    """Every matched module applied, covered or declined with a reason; no probe raised; local kinds applied."""
    check(report is not None, f"{what}: get_report returned None (was kernelize called on this object?)")
    silent = [f"{e.module} ({e.kind})" for e in report.entries
              if not (e.applied or e.covered) and not (e.reason or "").strip()]
    check(not silent, f"{what}: declined without a reason: {silent}", report)
    probes = [f"{e.module} ({e.kind}): {e.reason}" for e in report.entries
              if "probe forward raised" in (e.reason or "")]
    check(not probes, f"{what}: probes raised (a crash, not a deliberate decline): {probes}", report)
    for kind in LOCAL_KINDS:
        entries = [e for e in report.entries if e.kind == kind]
        check(bool(entries), f"{what}: no module matched as {kind}", report)
        # TP installs its own forward on the per-head q/k norms; those may be declined (with the reason above).
        missing = [f"{e.module}: {e.reason}" for e in entries
                   if not (e.applied or e.covered) and not e.module.endswith(("q_norm", "k_norm"))]
        check(not missing, f"{what}: {kind} got no kernel on {missing}", report)


def train(order: str | None, how: str, dtype_name: str, args: argparse.Namespace, path: str, mesh: Any,
          device: torch.device) -> dict[str, Any]:
    """One run: load, shard, kernelize per ``order``, then ``args.steps`` AdamW steps; losses averaged over ranks."""
    import kernels_core

    what = f"2-D {dtype_name} {order or 'eager'}"
    model = load(path, DTYPES[dtype_name], how, mesh, args.tp)

    def kernelize() -> Any:
        try:
            kernels_core.kernelize(model, mode=kernels_core.Mode.TRAINING)
        except Exception as exc:  # noqa: BLE001 - the failure to report, with its type
            fail(f"{what}: kernelize raised: {type(exc).__name__}: {exc}")
        return kernels_core.get_report(model)

    if how == "mesh" and tp_ranks(model) != args.tp:
        import transformers

        fail(f"--load mesh: transformers {transformers.__version__} split the model over {tp_ranks(model)} ranks, "
             f"not the mesh's {args.tp} (it ignores device_mesh); use --load native or auto")
    report = kernelize() if order == "before" else None
    if how == "mesh":
        wrap(model, "fsdp", device, mesh=mesh["dp"])
    if order == "after":
        report = kernelize()
    check_2d(model, what, args.tp)
    if order:
        check_kernels(report, what)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # One batch per data-parallel rank, the same in every run and on every rank of its TP group; repeated, so that
    # the loss falls and each step's update shows in the next loss.
    dp_rank = dist.get_rank() // args.tp
    generator = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(3, 1024, (2, args.seq), generator=generator).to(device)
    losses = []
    for step in range(args.steps):
        try:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        except Exception as exc:  # noqa: BLE001
            fail(f"{what}: training step {step} raised {type(exc).__name__}: {exc}", report)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(local(loss).detach().float())
    mean = torch.stack(losses)
    dist.all_reduce(mean)  # SUM (gloo has no AVG)
    return {"losses": (mean / dist.get_world_size()).tolist(), "report": report}


def describe(report: Any) -> str:
    """The kernels used and the reasons for declining, one line per distinct (module, kind, reason)."""
    def name(module: str) -> str:
        return re.sub(r"\.layers\.\d+\.", ".layers.*.", module) or "(model)"

    used = sorted({f"{e.kind}: {e.kernel}" for e in report.entries if e.applied})
    declined = sorted({f"{name(e.module)} ({e.kind}): {e.reason}" for e in report.entries
                       if not (e.applied or e.covered)})
    return "kernels used: " + "; ".join(used) + "\ndeclined: " + "\n          ".join(declined or ["(none)"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), action="append",
                        help="repeat for several (default: float32)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per data-parallel group")
    parser.add_argument("--load", choices=("auto", "mesh", "native"), default="auto",
                        help="how transformers builds the 2-D model (see above); auto: mesh where supported")
    parser.add_argument("--kernelize", default="before,after",
                        help="when kernelize runs, relative to fully_shard: before, after (comma-separated)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    dtypes = args.dtype or ["float32"]
    # FSDP2 warns on every step that eager's own modules (embedding, norms) return views; it would bury the report.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    from torch.distributed.device_mesh import init_device_mesh

    device = init_distributed(args.device)
    world = dist.get_world_size()
    if args.tp < 2 or world % args.tp or world // args.tp < 2:
        fail(f"--tp {args.tp} on {world} ranks: need tp >= 2 dividing the world size with at least 2 dp groups")
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    path = shared_checkpoint(args.layers, prefix="kernels-tp-fsdp-")

    how = args.load
    if how == "auto":
        how = "mesh" if tp_honours_mesh(path, DTYPES[dtypes[0]], mesh, args.tp) else "native"
    wanted = args.kernelize.split(",")
    unknown = sorted(set(wanted) - {"before", "after"})
    if unknown:
        fail(f"--kernelize {args.kernelize}: unknown {unknown}; allowed: before, after (comma-separated)")
    if how == "native" and "before" in wanted:
        log("NOTE: transformers applies TP and FSDP2 together here, so kernelize runs only after fully_shard")
        wanted.remove("before")
    check(bool(wanted), "nothing to compare: --kernelize before is impossible with --load native")
    orders = (None, *(order for order in ("before", "after") if order in wanted))
    log(f"load {how}: mesh (dp {world // args.tp}, tp {args.tp}); runs: "
        + ", ".join(order or "eager" for order in orders))
    for dtype_name in dtypes:
        what = f"2-D {dtype_name}"
        runs = {}
        for order in orders:
            runs[order or "eager"] = run = train(order, how, dtype_name, args, path, mesh, device)
            log(f"{what}: losses {'eager' if order is None else f'kernelize {order} fully_shard'} {run['losses']}")
            if order:
                log(run["report"].table())
                log(describe(run["report"]))
        pair_tol, eager_tol = TOLERANCES[dtype_name]
        eager = runs["eager"]["losses"]
        for order in orders[1:]:
            for step, (e, k) in enumerate(zip(eager, runs[order]["losses"], strict=True)):
                check(rel(k, e) <= eager_tol, f"{what} kernelize {order} fully_shard, step {step}: loss {k} vs "
                      f"eager {e} (relative {rel(k, e):.2e}, tolerance {eager_tol})", runs[order]["report"])
        if "before" in runs and "after" in runs:
            before, after = runs["before"], runs["after"]
            differ = choice_differences(before["report"], after["report"])
            check(not differ, f"{what}: kernel choices depend on the order (before / after): {differ}",
                  after["report"])
            for step, (b, a) in enumerate(zip(before["losses"], after["losses"], strict=True)):
                check(rel(a, b) <= pair_tol, f"{what} step {step}: kernelize before fully_shard {b} vs after {a} "
                      f"(tolerance {pair_tol})")
        worst = max(rel(k, e) for order in orders[1:] for k, e in zip(runs[order]["losses"], eager, strict=True))
        log(f"{what} ({how}; kernelize {', '.join(orders[1:])} fully_shard): OK; worst loss difference from eager "
            f"{worst:.2e} over {args.steps} steps; {runs[orders[-1]]['report'].summary()}")
    finish(path)


if __name__ == "__main__":
    main()
