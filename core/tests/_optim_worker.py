"""One rank of the local-shard optimizer checks (``test_optim.py``): FSDP2 over gloo on two CPU processes.

For each optimizer setting the same sharded model (a tiny Qwen3, one FSDP2 unit per decoder layer) trains twice
from the same seed on the same data: once with the optimizer stepping through DTensor dispatch, once after
``step_on_local_shards``. The worker records whether every parameter (gathered) and every state value is bitwise
the same, what type the states are, and the edge cases: a step that raises inside the optimizer,
``restore_step``, a Partial placement. Not collected by pytest.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).resolve().parent))

import two_ranks  # noqa: E402
from kernels_core.optim import local_shard_problem  # noqa: E402
from kernels_core.optim import restore_step  # noqa: E402
from kernels_core.optim import step_on_local_shards  # noqa: E402
from kernels_core.testing import tiny_causal_lm  # noqa: E402


STEPS = 5
SETTINGS = {
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_for_loop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=True),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
    "rmsprop_centered": lambda p: torch.optim.RMSprop(p, lr=1e-3, centered=True, momentum=0.5, foreach=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, foreach=True),
}


def _model(*, replicated: bool = False) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # One FSDP2 unit per decoder layer, then the root, as training scripts shard. The odd vocabulary leaves the two
    # ranks embedding and lm_head shards of unequal length. The mesh is the CPU's: without one, fully_shard picks
    # the GPU where a CUDA build sees one, which these CPU modules and gloo are not on. ``replicated``: HSDP's 2-D
    # mesh, replicated over the two ranks and sharded over one (placements Replicate, Shard(0)).
    world = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if replicated
            else init_device_mesh("cpu", (world,)))
    model = tiny_causal_lm("qwen3", seed=0, vocab_size=101)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(make, *, local: bool, scheduler_first: bool = False, failing_step: int | None = None,
           replicated: bool = False) -> dict:
    model = _model(replicated=replicated)
    optimizer = make(model.parameters())
    scheduler = None
    if scheduler_first:  # an LR scheduler wrapping the step before step_on_local_shards is called
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    if local:
        step_on_local_shards(optimizer)
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    raised = []
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    for index in range(STEPS):
        ids = torch.randint(3, 101, (2, 9), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        if index == failing_step:
            def fail(*_):
                raise RuntimeError("a step pre-hook failed")

            handle = optimizer.register_step_pre_hook(fail)
            try:
                optimizer.step()
            except RuntimeError as exc:
                raised.append(str(exc))
            handle.remove()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            raised.append(all(type(p).__name__ == "DTensor" for p in params))
            raised.append(all(type(key).__name__ == "DTensor" for key in optimizer.state))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    caught.__exit__(None, None, None)
    states = [value for state in optimizer.state.values() for value in state.values()]
    return {
        "params": [p.full_tensor() for p in model.parameters()],
        "states": [v.full_tensor() if hasattr(v, "full_tensor") else v for v in states],
        "state_types": sorted({type(v).__name__ for v in states if torch.is_tensor(v) and v.dim() > 0}),
        "raised": raised,
        "warnings": [str(w.message) for w in seen],
        "optimizer": optimizer,
    }


def _same(a: dict, b: dict) -> bool:
    return (len(a["params"]) == len(b["params"]) and len(a["states"]) == len(b["states"])
            and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
            and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y))
                    for x, y in zip(a["states"], b["states"], strict=True)))


def main() -> None:
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result: dict[str, object] = {}
    for name, make in SETTINGS.items():
        plain, local = _train(make, local=False), _train(make, local=True)
        result[name] = {"bitwise": _same(plain, local), "state_types": local["state_types"],
                        "plain_state_types": plain["state_types"]}
    make = SETTINGS["adamw_foreach"]
    hsdp_plain, hsdp_local = _train(make, local=False, replicated=True), _train(make, local=True, replicated=True)
    hsdp_params = hsdp_local["optimizer"].param_groups[0]["params"]
    result["hsdp"] = {"bitwise": _same(hsdp_plain, hsdp_local), "state_types": hsdp_local["state_types"],
                      "placements": sorted({str(p.placements) for p in hsdp_params})}
    plain = _train(make, local=False)
    first = _train(make, local=True, scheduler_first=True)
    after = _train(make, local=True)
    result["scheduler"] = {"first_bitwise": _same(plain, first), "after_bitwise": _same(plain, after),
                           "warnings": plain["warnings"] + first["warnings"] + after["warnings"]}
    failed = _train(make, local=True, failing_step=2)
    result["failing_step"] = {"raised": failed["raised"], "then_bitwise": _same(plain, failed)}
    optimizer = failed["optimizer"]
    result["restore"] = {"first": restore_step(optimizer), "again": restore_step(optimizer),
                         "instance_step_left": "step" in vars(optimizer)}
    result["installed_twice_same"] = step_on_local_shards(optimizer) is step_on_local_shards(optimizer)

    class Wrapper:  # keeps the optimizer as .optimizer, as accelerate's AcceleratedOptimizer does
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    restore_step(optimizer)
    result["through_wrapper"] = {"installed": step_on_local_shards(Wrapper(optimizer)) is not None,
                                 "on_inner": "step" in vars(optimizer),
                                 "restored": restore_step(Wrapper(optimizer)) and "step" not in vars(optimizer)}

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    partial = torch.nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Partial()]))
    result["partial"] = local_shard_problem(torch.optim.SGD([partial], lr=0.1))
    two_ranks.finish(out, "optim", dist.get_rank(), result)


if __name__ == "__main__":
    main()
