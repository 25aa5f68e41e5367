"""One rank of the Trainer-under-DDP / FSDP2 checks: the plain Trainer, then the Trainer with ``KernelizeCallback``.

Run by ``test_trainer_distributed.py`` as two CPU processes over gloo (``python -m torch.distributed.run
--nproc_per_node 2 _trainer_distributed_worker.py SCENARIO OUT_DIR``); the Trainer reads ``WORLD_SIZE`` /
``LOCAL_RANK`` and wraps the model itself. Each rank writes its per-step losses, how the Trainer wrapped the
model and what the callback applied, as JSON. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels_core  # noqa: E402
import two_ranks  # noqa: E402
from _trainer_helpers import pad_collate  # noqa: E402
from _trainer_helpers import step_losses  # noqa: E402
from _trainer_helpers import token_dataset  # noqa: E402
from kernels_core.integrations.transformers import KernelizeCallback  # noqa: E402
from kernels_core.testing import fresh_plugin_manager  # noqa: E402
from kernels_core.testing import tiny_causal_lm  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers import TrainingArguments  # noqa: E402


STEPS = 8


def _args(scenario: str, out_dir: Path, which: str) -> TrainingArguments:
    settings = dict(output_dir=str(out_dir / which), per_device_train_batch_size=2, max_steps=STEPS,
                    logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", seed=0, use_cpu=True,
                    disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo")
    if scenario == "fsdp":
        # The decoder layer as the wrap unit, as real FSDP2 runs name it.
        settings.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                                          "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]})
    return TrainingArguments(**settings)


def _force_fsdp(trainer: Trainer) -> None:
    """Put the Trainer's accelerator on its FSDP path, which accelerate does not take on CPU by itself.

    accelerate's ``AcceleratorState`` keeps the FSDP plugin only for multi-accelerator distributed types (GPU, NPU,
    XPU, ...); with ``use_cpu=True`` the type is MULTI_CPU, the plugin is dropped without a message and the Trainer
    wraps in DDP. Set after ``Trainer.__init__`` (after the callback kernelized, before anything is wrapped),
    ``accelerator.prepare`` in ``train()`` then runs accelerate's own FSDP2 preparation (``fully_shard`` per the
    auto-wrap policy) over gloo.
    """
    from accelerate.utils import DistributedType
    from accelerate.utils import FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def _train(scenario: str, out_dir: Path, which: str) -> dict[str, object]:
    model = tiny_causal_lm("qwen3", seed=0)
    callback = KernelizeCallback(plugin_manager=fresh_plugin_manager()) if which == "kernelized" else None
    trainer = Trainer(model=model, args=_args(scenario, out_dir, which), train_dataset=token_dataset(32),
                      data_collator=pad_collate, callbacks=[callback] if callback else [])
    fsdp_by_itself = trainer.is_fsdp_enabled
    if scenario == "fsdp" and not fsdp_by_itself:
        _force_fsdp(trainer)
    # The fused loss reads lm_head's weight and never calls lm_head: its forward hook counts eager loss steps.
    lm_head_calls = []
    model.lm_head.register_forward_hook(lambda *_: lm_head_calls.append(1))
    trainer.train()
    report = kernels_core.get_report(model)
    from torch.distributed.tensor import DTensor

    return {
        "losses": step_losses(trainer),
        "world_size": trainer.args.world_size,
        "fsdp_by_itself": fsdp_by_itself,
        "lm_head_calls": len(lm_head_calls),
        "wrapper": type(trainer.model_wrapped).__name__,
        "fsdp2_sharded": bool(list(model.parameters())) and all(isinstance(p, DTensor) for p in model.parameters()),
        "fsdp2_modules": sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")}),
        "applied": sorted({e.kind for e in report.applied}) if report else [],
        "declined": {e.module + "|" + e.kind: e.reason for e in report.entries
                     if not e.applied and not e.covered} if report else {},
        "loss_owner": callback.loss if callback else None,
        "optimizer_step": callback.optimizer_step if callback else None,
    }


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    result = {which: _train(scenario, out_dir, which) for which in ("plain", "kernelized")}
    two_ranks.finish(out_dir, scenario, int(os.environ["RANK"]), result)


if __name__ == "__main__":
    main()
