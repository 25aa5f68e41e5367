"""One process of the real-DeepSpeed checks (``test_deepspeed.py``): ZeRO-2 / ZeRO-3 on the CPU over gloo.

    python _deepspeed_worker.py SCENARIO OUT_DIR      # RANK=0 WORLD_SIZE=1 MASTER_ADDR/PORT set by the caller

Scenarios, each writing ``OUT_DIR/SCENARIO.json``:

- ``engine``: ``deepspeed.initialize`` directly, ZeRO-3 (every parameter partitioned:
  ``stage3_param_persistence_threshold`` 0) and ZeRO-2; the same seeded model trained without kernels-core and
  kernelized before the engine (full parameters), after ``deepspeed.zero.Init`` partitioned them but before the
  engine (ZeRO-3), and after the engine. Per run: every step's loss, every parameter's whole gradient of the first
  step (``deepspeed.utils.safe_get_full_grad``) and the report.
- ``accelerate``: ``Accelerator(deepspeed_plugin=...)``, ZeRO-3, kernelized before and after ``prepare``.
- ``trainer3`` / ``trainer2``: the transformers Trainer with ``deepspeed=`` ZeRO-3 / ZeRO-2: plain; with
  ``KernelizeCallback`` (the model loads under ``zero.Init`` when the arguments exist first, so under ZeRO-3 the
  callback kernelizes partitioned parameters, before the engine); with the callback added after the Trainer was
  built (it kernelizes in ``on_train_begin``, after the engine); and kernelized before the Trainer (model built
  first, full parameters), against the plain Trainer on a model built first. ZeRO-2: plain and the callback.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels_core  # noqa: E402
import reference_plugin  # noqa: E402
from _trainer_helpers import pad_collate  # noqa: E402
from _trainer_helpers import step_losses  # noqa: E402
from _trainer_helpers import token_dataset  # noqa: E402
from kernels_core import Mode  # noqa: E402
from kernels_core.testing import fresh_plugin_manager  # noqa: E402
from kernels_core.testing import tiny_causal_lm  # noqa: E402


STEPS = 3
TRAINER_STEPS = 6


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # norms partitioned too, not kept whole
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, **extra}


def _model(**overrides: Any) -> torch.nn.Module:
    model = tiny_causal_lm("qwen3", seed=0, **overrides).train()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def _report(model: torch.nn.Module) -> dict[str, Any]:
    report = kernels_core.get_report(model)
    if report is None:
        return {}
    return {f"{e.module}|{e.kind}": e.kernel or ("covered" if e.covered else f"declined: {e.reason}")
            for e in report.entries}


def _engine_run(stage: int, order: str) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    pm = fresh_plugin_manager((reference_plugin, "reference"))
    config = _config(stage)
    if order in ("init", "init-eager"):
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig({**config, "train_batch_size": 2})  # the model loads under deepspeed.zero.Init
        model = _model()
        del keep
    else:
        model = _model()
    partitioned_at_kernelize = hasattr(model.lm_head.weight, "ds_id")
    if order in ("before", "init"):
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                      config=config)
    if order == "after":
        kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
    gen = torch.Generator().manual_seed(11)
    losses, grads = [], {}
    reference_plugin.CALLS.clear()
    for step in range(STEPS):
        ids = torch.randint(3, 100, (2, 9), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if step == 0:
            for name, param in model.named_parameters():
                grad = safe_get_full_grad(param)
                grads[name] = None if grad is None else grad.flatten().tolist()
        engine.step()
        losses.append(float(loss))
    gathered_after = sorted(n for n, p in model.named_parameters() if stage == 3 and p.numel() != 0)
    # Inside engine.forward DeepSpeed gathers a partitioned parameter that code reads without calling its module,
    # and registers it as an "external parameter" of the running module, which from then on gathers it for its
    # whole forward and backward (lm_head's weight on the root module: the whole model's forward).
    external = sorted(f"{name or '(model)'}: {sorted(getattr(m, '_external_params', {}))}" for name, m
                      in model.named_modules() if getattr(m, "_external_params", None))
    engine.destroy()
    return {"losses": losses, "grads": grads, "report": _report(model), "calls": dict(reference_plugin.CALLS),
            "partitioned_at_kernelize": partitioned_at_kernelize, "gathered_after_step": gathered_after,
            "external_parameters": external}


def engine() -> dict[str, Any]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    runs = {f"3-{order}": _engine_run(3, order) for order in ("eager", "before", "after", "init-eager", "init")}
    runs.update({f"2-{order}": _engine_run(2, order) for order in ("eager", "before", "after")})
    return runs


def accelerate() -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    # No cpu=True: accelerate would drop the DeepSpeed plugin for it. Without a GPU it runs DeepSpeed on the CPU.
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config(3)))
    pm = fresh_plugin_manager((reference_plugin, "reference"))
    runs = {}
    for order in ("eager", "before", "after"):
        model = _model()  # under the plugin's zero.Init: partitioned already
        partitioned = hasattr(model.lm_head.weight, "ds_id")
        if order == "before":
            kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        wrapped, optimizer = accelerator.prepare(model, optimizer)
        if order == "after":
            kernels_core.kernelize(wrapped.module, mode=Mode.TRAINING, plugin_manager=pm)
        gen = torch.Generator().manual_seed(11)
        losses = []
        reference_plugin.CALLS.clear()
        for _ in range(STEPS):
            ids = torch.randint(3, 100, (2, 9), generator=gen)
            loss = wrapped(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        runs[order] = {"losses": losses, "report": _report(model), "calls": dict(reference_plugin.CALLS),
                       "wrapper": type(wrapped).__name__, "partitioned_at_kernelize": partitioned}
        accelerator.free_memory()
    return runs


def _trainer_args(stage: int, out_dir: Path, which: str) -> Any:
    from transformers import TrainingArguments

    config = {**_config(stage), "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto"}
    return TrainingArguments(output_dir=str(out_dir / which), per_device_train_batch_size=2,
                             max_steps=TRAINER_STEPS, logging_steps=1, learning_rate=1e-3, report_to=[],
                             save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                             deepspeed=config)


def _trainer_run(stage: int, out_dir: Path, which: str) -> dict[str, Any]:
    from kernels_core.integrations.transformers import KernelizeCallback
    from transformers import Trainer

    pm = fresh_plugin_manager()
    callback = None
    if which in ("before", "plain-before"):
        # The model exists before the arguments: no zero.Init (the earlier runs' configuration is dropped), full
        # parameters when kernelize runs.
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        model = _model()
        if which == "before":
            kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=pm)
        args = _trainer_args(stage, out_dir, which)
    else:
        args = _trainer_args(stage, out_dir, which)  # ZeRO-3: the model below loads under deepspeed.zero.Init
        model = _model()
        if which in ("callback", "late"):
            callback = KernelizeCallback(plugin_manager=pm)
    partitioned_at_load = hasattr(model.lm_head.weight, "ds_id")
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(32), data_collator=pad_collate,
                      callbacks=[callback] if which == "callback" else [])
    if which == "late":
        # Added after the Trainer was built: on_init_end has passed, the callback kernelizes in on_train_begin,
        # after DeepSpeed's engine exists.
        trainer.add_callback(callback)
    trainer.train()
    return {"losses": step_losses(trainer), "report": _report(model), "wrapper": type(trainer.model_wrapped).__name__,
            "partitioned_at_load": partitioned_at_load, "loss_owner": callback.loss if callback else None}


def trainer(stage: int, out_dir: Path) -> dict[str, Any]:
    # ZeRO-2 partitions no weight a kernel reads: the engine-level runs cover its orders; here, the callback.
    runs = ("plain", "callback", "late", "plain-before", "before") if stage == 3 else ("plain", "callback")
    return {which: _trainer_run(stage, out_dir, which) for which in runs}


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if scenario == "engine":
        result = engine()
    elif scenario == "accelerate":
        result = accelerate()
    else:
        result = trainer(int(scenario.removeprefix("trainer")), out_dir)
    (out_dir / f"{scenario}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # Every result is on disk; leave without the interpreter's teardown (gloo's threads may abort it now and then).
    os._exit(0)


if __name__ == "__main__":
    main()
