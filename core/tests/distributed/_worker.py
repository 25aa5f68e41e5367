"""One rank of the CPU (gloo) ordering checks: kernelize before or after FSDP2 / DDP wrapping must not matter.

Run by ``test_ordering.py`` as two processes (``python _worker.py SCENARIO OUT_DIR`` with the usual
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` variables); each rank writes what it saw as JSON.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels_core  # noqa: E402
import reference_plugin  # noqa: E402
import two_ranks  # noqa: E402
from kernels_core import Mode  # noqa: E402
from kernels_core.testing import fresh_plugin_manager  # noqa: E402
from kernels_core.testing import tiny_causal_lm  # noqa: E402


STEPS = 3


def _wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _kernels(model: torch.nn.Module) -> dict[str, object]:
    # Kernelized before DDP, the report is on the wrapped model; after, on the wrapper, whose names all start
    # with "module". The comparison is about the same modules either way.
    report = kernels_core.get_report(model) or kernels_core.get_report(getattr(model, "module", model))
    if report is None:
        return {}
    names = {e.module: ("" if e.module == "module" else e.module.removeprefix("module.")) for e in report.entries}
    # A covered module's enclosing module is named differently under the wrapper: the covering kernel is compared.
    return {f"{names[e.module]}|{e.kind}": e.kernel or (f"covered by {e.covered_by}" if e.covered
                                                       else f"declined: {e.reason}") for e in report.entries}


def _run(scenario: str, order: str) -> dict[str, object]:
    how = scenario
    pm = fresh_plugin_manager((reference_plugin, "reference"))
    model = tiny_causal_lm("qwen3", seed=0)
    if order == "before":
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    model = _wrap(model, how)
    if order == "after":
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    sharded_after_kernelize = None
    if how == "fsdp":
        from torch.distributed.tensor import DTensor

        sharded_after_kernelize = all(isinstance(p, DTensor) for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data, as in training
    losses = []
    reference_plugin.CALLS.clear()
    for _ in range(STEPS):
        ids = torch.randint(3, 100, (2, 11), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return {
        "kernels": _kernels(model),
        "losses": losses,
        "called": sorted(reference_plugin.CALLS),
        "sharded_after_kernelize": sharded_after_kernelize,
    }


def _load_tensor_parallel(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        from transformers import DistributedConfig
    except ImportError:  # transformers before the DistributedConfig API took tp_plan directly
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return float(loss), grads


def _run_tensor_parallel(out_dir: Path) -> dict[str, object]:
    """tp_plan="auto": eager TP against kernelized TP on the same sharded model, loss and every gradient."""
    path = out_dir / "model"
    if dist.get_rank() == 0:
        model = tiny_causal_lm("qwen3", hidden_size=64, head_dim=16, intermediate_size=96, vocab_size=102)
        model.save_pretrained(path)
    dist.barrier()
    ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(5))
    # Kernelized straight after loading, before any forward: transformers' TP wrappers register their gradient
    # all-reduce hooks on their first call, which a kernel replacing them would skip.
    model = _load_tensor_parallel(path).train()
    # transformers 5.6 shards with plain local tensors and keeps lm_head whole; later releases use DTensors, shard
    # lm_head over the vocabulary and wrap q_norm/k_norm's forward per instance. Both are recorded before kernelize.
    from transformers import AutoModelForCausalLM

    full = {n: p.shape for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}
    sharded = sorted(n for n, p in model.named_parameters() if hasattr(p, "placements") or p.shape != full[n])
    lm_head = model.lm_head.weight
    lm_head_sharded = hasattr(lm_head, "placements") or lm_head.shape[0] != model.config.vocab_size
    tp_wrapped_norms = "forward" in model.model.layers[0].self_attn.q_norm.__dict__
    pm = fresh_plugin_manager((reference_plugin, "reference"))
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    reference_plugin.CALLS.clear()
    loss, grads = _loss_and_grads(model, ids)
    eager_loss, eager_grads = _loss_and_grads(_load_tensor_parallel(path).train(), ids)
    grad_error = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                     for n, g in eager_grads.items())
    return {"kernels": _kernels(model), "eager_loss": eager_loss, "loss": loss, "max_grad_rel_error": grad_error,
            "called": sorted(reference_plugin.CALLS),
            "tp_wrapped_norms": tp_wrapped_norms, "lm_head_sharded": lm_head_sharded, "sharded": sharded}


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if scenario == "tp":
        result = _run_tensor_parallel(out_dir)
    else:
        result = {order: _run(scenario, order) for order in ("eager", "before", "after")}
    two_ranks.finish(out_dir, scenario, dist.get_rank(), result)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
