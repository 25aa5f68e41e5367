"""``KernelizeCallback``: kernelize the model a transformers ``Trainer`` (or a TRL trainer) trains.

The callback kernelizes in ``on_init_end``, at the end of ``Trainer.__init__``, when nothing has wrapped the model
yet. The model is usually on its device by then; under FSDP (and other setups where accelerate places the
model itself) it is still on the CPU, and kernels are chosen for the device the Trainer trains on
(``args.device``). What the Trainer adds later keeps calling the kernels: accelerate's
mixed-precision wrapper (``bf16=True``) wraps the kernelized forward, DDP and FSDP2 are handled by kernelize in
either order, ``torch.compile`` traces the kernels at the first step, and TRL's fused LM head, patched in after
``Trainer.__init__``, wraps the kernelized forward. Had the callback waited for ``on_train_begin`` (which in
transformers 5.23 fires after ``accelerator.prepare``), accelerate's mixed-precision wrapper would already be the
instance forward of the ``*ForCausalLM`` and the loss kind would have to leave it alone. ``on_train_begin``
kernelizes only a model that is not kernelized yet (``model_init`` builds a new one in ``train()``, the callback
was added after the Trainer was built, or the weights arrive only with ``accelerator.prepare``: FSDP's
``cpu_ram_efficient_loading``, meta parameters), then logs the summary and writes the report.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.trainer_callback import TrainerCallback
from transformers.utils import logging as hf_logging

from .._binding import forward_slot
from .._binding import store_report
from .._binding import stored_report
from .._config import KernelsConfig
from .._config import load_config
from .._errors import ConfigError
from .._errors import KernelizeError
from .._kernelize import get_report
from .._kernelize import kernelize
from .._plugins._manager import KernelsPluginManager
from .._plugins._manager import get_plugin_manager
from .._report import KernelizeReport
from .._resolve import find_backend
from .._types import BackendInfo
from .._types import Mode
from ..optim import NO_DTENSOR
from ..optim import _inner
from ..optim import local_shard_problem
from ..optim import step_on_local_shards
from ._fp8 import apply_fp8
from ._fp8 import check_fp8


__all__ = ["REPORT_FILE", "KernelizeCallback", "loss_owner"]

# A child of the Trainer's logger: it follows the Trainer's log_level / log_level_replica settings.
logger = hf_logging.get_logger("transformers.trainer.kernels_core")

REPORT_FILE = "kernelize_report.json"
_TRL_HEAD = "TRL's fused LM head (trl add_fused_lm_head)"


def _unwrap(model: nn.Module) -> nn.Module:
    """The module under torch.compile's OptimizedModule and DDP / DataParallel (FSDP2 shards in place)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = model.module if isinstance(getattr(model, "module", None), nn.Module) and type(model).__name__ in (
                "DistributedDataParallel", "DataParallel") else None
        if inner is None:
            return model
        model = inner


def _trl_head(module: nn.Module) -> bool:
    """Whether TRL's ``add_fused_lm_head`` wrapper is this module's instance forward.

    TRL copies the class forward's name onto its wrapper (``functools.wraps``), so it is recognised by its code.
    """
    namespace = module.__dict__
    # accelerate's mixed-precision wrapper keeps the forward it wrapped in _original_forward.
    value = namespace.get("_original_forward", namespace.get(forward_slot(module)))
    fn = getattr(value, "__func__", value)
    globals_ = getattr(fn, "__globals__", None) or {}
    return str(globals_.get("__name__", "")).startswith("trl.") and getattr(
        getattr(fn, "__code__", None), "co_name", "") == "_fused_forward"


def loss_owner(model: nn.Module) -> str:
    """Which code computes the training loss of a (kernelized) causal LM, in one sentence.

    Example:
        >>> import torch
        >>> loss_owner(torch.nn.Linear(2, 2))
        'not kernelized: the model computes its own loss'
    """
    report = get_report(model)
    if report is None:
        return "not kernelized: the model computes its own loss"
    entries = [e for e in report.entries if e.kind == "causal_lm_loss"]
    if not entries:
        return "no causal-LM head matched: the model computes its own loss"
    parts = []
    for entry in entries:
        module = model.get_submodule(entry.module) if entry.module else model
        where = entry.module or type(module).__name__
        if _trl_head(module):
            under = (f"; kernels-core's {entry.kernel} sits under it and runs only when TRL calls the model's own "
                     "forward with labels" if entry.applied else "")
            parts.append(f"{where}: {_TRL_HEAD} computes the loss and the per-token log-probabilities TRL's "
                         f"metrics use{under}")
        elif entry.applied:
            parts.append(f"{where}: kernels-core's fused loss {entry.kernel} computes the training loss (no logits "
                         "in training steps; evaluation and generation run the model's own forward, with logits)")
        else:
            parts.append(f"{where}: the model's own forward computes the loss ({entry.reason})")
    return "; ".join(parts)


def _annotate_trl(model: nn.Module) -> None:
    """Say in the report that TRL's fused LM head is the foreign forward the loss kind left alone."""
    # The stored report, not get_report's view of the model as it is now, which must not be frozen into it.
    report = stored_report(model)
    if report is None:
        return
    entries = []
    for entry in report.entries:
        module = model.get_submodule(entry.module) if entry.module else model
        said = _TRL_HEAD in (entry.note or entry.reason or "")
        if entry.kind == "causal_lm_loss" and _trl_head(module) and not said:
            if entry.applied:
                entry = dataclasses.replace(entry, note=f"{_TRL_HEAD} wraps this forward and computes the training "
                                                        "loss; the kernel runs only when TRL calls the model's own "
                                                        "forward with labels")
            else:
                entry = dataclasses.replace(entry, reason=f"{_TRL_HEAD} runs here and computes the loss; "
                                                          f"{entry.reason}")
        entries.append(entry)
    store_report(model, dataclasses.replace(report, entries=tuple(entries)))


def training_device(args: Any, model: nn.Module, backends: list[tuple[BackendInfo, Any]]) -> torch.device | None:
    """The accelerator the Trainer will train ``model`` on, when the model is not there yet and an installed
    plugin detects it (``backends``: the plugin manager's); else None, and each module's own device decides.

    Under FSDP the Trainer leaves the model on the CPU until ``accelerator.prepare`` shards it onto the
    accelerator, after ``on_init_end``; resolved by the parameters' device, that model would get CPU kernels.

    Example:
        >>> from types import SimpleNamespace
        >>> from kernels_core import BackendInfo, DeviceInfo
        >>> gpus = (DeviceInfo(0, "GPU"), DeviceInfo(1, "GPU"))
        >>> cuda = BackendInfo(backend="cuda", device_type="cuda", devices=gpus)
        >>> training_device(SimpleNamespace(device=torch.device("cuda", 1)), torch.nn.Linear(2, 2), [(cuda, None)])
        device(type='cuda', index=1)
        >>> training_device(SimpleNamespace(device=torch.device("cuda", 1)), torch.nn.Linear(2, 2), []) is None
        True
    """
    want = getattr(args, "device", None)
    if want is None or torch.device(want).type in ("cpu", "meta"):
        return None
    where = {p.device.type for p in model.parameters()}
    if not where or not where <= {"cpu", "meta"}:
        return None
    return torch.device(want) if find_backend(torch.device(want), backends)[0] is not None else None


def weights_arrive_later(args: Any, model: nn.Module) -> str | None:
    """Why the model's weights are not there yet at ``on_init_end`` (kernelize then waits for training), or None.

    With FSDP's ``cpu_ram_efficient_loading`` only the first process loads the weights; the others hold meta
    tensors until ``accelerator.prepare`` broadcasts them. Kernel choices check a module's math on its weights,
    so every process waits for them: a choice made on rank 0 alone would differ from the other ranks'.

    Example:
        >>> from types import SimpleNamespace
        >>> weights_arrive_later(SimpleNamespace(fsdp=[], fsdp_config={}), torch.nn.Linear(2, 2)) is None
        True
        >>> fsdp = SimpleNamespace(fsdp=["full_shard"], fsdp_config={"cpu_ram_efficient_loading": "true"})
        >>> weights_arrive_later(fsdp, torch.nn.Linear(2, 2))[:40]
        "fsdp_config's cpu_ram_efficient_loading "
    """
    fsdp_config = (getattr(args, "fsdp_config", None) or {}) if getattr(args, "fsdp", None) else {}
    if str(fsdp_config.get("cpu_ram_efficient_loading", "false")).lower() == "true":
        return ("fsdp_config's cpu_ram_efficient_loading loads the weights on the first process only; the others "
                "receive them when accelerate prepares the model")
    if any(p.device.type == "meta" for p in model.parameters()):
        return "parameters are on the meta device; their weights arrive when accelerate prepares the model"
    return None


def _check_config(config: object) -> None:
    if config is not None and not isinstance(config, (dict, str, os.PathLike, KernelsConfig)):
        raise TypeError(f"KernelizeCallback option 'config' must be a dict, a TOML path (str or os.PathLike) or a "
                        f"kernels_core.KernelsConfig, got {type(config).__name__} {config!r}")
    try:
        load_config(config)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"KernelizeCallback option 'config': {exc}") from exc


class KernelizeCallback(TrainerCallback):
    """Kernelize the model a ``Trainer`` trains, under whatever wrapping the Trainer applies.

    The mode is ``Mode.TRAINING``, plus ``Mode.TORCH_COMPILE`` when ``TrainingArguments.torch_compile`` is set.
    The summary is logged on the Trainer's logger (``transformers.trainer.kernels_core``, at INFO, main process
    by the Trainer's ``log_level``); the main process writes the full report, with a ``loss`` line saying which
    code computes the loss, to ``<output_dir>/kernelize_report.json``. The kernels stay after training, so
    ``trainer.evaluate()``, ``save_model`` and further ``train()`` calls see the same model; call
    ``kernels_core.unkernelize(model)`` to restore it.

    Example:
        >>> from kernels_core import Mode
        >>> KernelizeCallback(mode=Mode.TRAINING)
        KernelizeCallback(mode=<Mode.TRAINING: 2>, config=None, strict=False)
        >>> KernelizeCallback(strict="yes")
        Traceback (most recent call last):
        ...
        TypeError: KernelizeCallback option 'strict' must be a bool, got str 'yes'

    Args:
        mode: the kernelize mode; by default from ``TrainingArguments.torch_compile`` as above.
        config: a dict, TOML path or ``KernelsConfig``, as for ``kernelize``; checked when the callback is made.
        strict: raise if a matched module gets no kernel.
        fp8: ``"rowwise"`` or ``"tensorwise"``: run the decoder layers' linear projections as FP8 matrix products
            with torchao's recipe of that name (kernels-cuda's ``cuda.linear.float8_<recipe>``; needs
            ``kernels-cuda[fp8]``, a GPU of compute capability 8.9 or newer, bf16 weights and
            ``TrainingArguments(torch_compile=True)``, else training does not start: ``KernelizeError``). Short for
            ``[kinds.linear] prefer = { any = [...] }``; ``None`` (default) keeps them in bf16.
        local_shard_step: under FSDP2, have the Trainer's optimizer step on the parameters' local shards
            (:func:`kernels_core.optim.step_on_local_shards`: the same update, bitwise, without DTensor dispatch).
            ``None`` (default): when the optimizer is one of the elementwise ``torch.optim`` classes and the
            parameters are DTensors, else the optimizer is left alone with the reason logged; ``True``: required
            (``KernelizeError`` when training begins if it cannot be done); ``False``: never.
        plugin_manager: use this plugin manager instead of the process-wide one (tests, embedding frameworks).

    Raises:
        TypeError / ValueError / ConfigError: an option is malformed (at construction).
        KernelizeError: kernelize failed when training began (from ``trainer.train()``); the model is unchanged.
        ValueError: ``use_liger_kernel=True`` is set too; both replace the same layers.
    """

    def __init__(self, *, mode: Mode | None = None, config: dict[str, Any] | str | os.PathLike[str] | KernelsConfig
                 | None = None, strict: bool = False, fp8: str | None = None,
                 local_shard_step: bool | None = None, plugin_manager: KernelsPluginManager | None = None) -> None:
        if mode is not None:
            if not isinstance(mode, Mode):
                raise TypeError(f"KernelizeCallback option 'mode' must be a kernels_core.Mode (Mode.TRAINING, "
                                f"optionally | Mode.TORCH_COMPILE) or None, got {type(mode).__name__} {mode!r}")
            try:
                mode.validate()
            except ValueError as exc:
                raise ValueError(f"KernelizeCallback option 'mode': {exc}") from exc
        if not isinstance(strict, bool):
            raise TypeError(f"KernelizeCallback option 'strict' must be a bool, got {type(strict).__name__} "
                            f"{strict!r}")
        if local_shard_step is not None and not isinstance(local_shard_step, bool):
            raise TypeError(f"KernelizeCallback option 'local_shard_step' must be a bool or None, got "
                            f"{type(local_shard_step).__name__} {local_shard_step!r}")
        if plugin_manager is not None and not isinstance(plugin_manager, KernelsPluginManager):
            raise TypeError(f"KernelizeCallback option 'plugin_manager' must be a KernelsPluginManager or None, got "
                            f"{type(plugin_manager).__name__}")
        _check_config(config)
        self.fp8 = check_fp8(fp8, "KernelizeCallback option 'fp8'")
        self.mode = mode
        self.config = config
        self.strict = strict
        self.local_shard_step = local_shard_step
        self.plugin_manager = plugin_manager
        self.report: KernelizeReport | None = None
        self.loss: str | None = None
        # How the optimizer steps (the local-shard path, or why not), once training began under FSDP2.
        self.optimizer_step: str | None = None

    def __repr__(self) -> str:
        fp8 = f", fp8={self.fp8!r}" if self.fp8 is not None else ""
        local = "" if self.local_shard_step is None else f", local_shard_step={self.local_shard_step!r}"
        return f"KernelizeCallback(mode={self.mode!r}, config={self.config!r}, strict={self.strict!r}{fp8}{local})"

    def _mode(self, args: Any) -> Mode:
        if self.mode is not None:
            return self.mode
        return Mode.TRAINING | Mode.TORCH_COMPILE if getattr(args, "torch_compile", False) else Mode.TRAINING

    def _kernelize(self, args: Any, target: nn.Module, when: str) -> None:
        if getattr(args, "use_liger_kernel", False):
            raise ValueError("KernelizeCallback and TrainingArguments(use_liger_kernel=True) both replace the same "
                             "layers (norms, MLPs, RoPE, the loss); use one of them")
        mode = self._mode(args)
        manager = self.plugin_manager or get_plugin_manager()
        device = training_device(args, target, manager.backends())
        if device is not None:
            logger.info("KernelizeCallback: the model is on the CPU %s and the Trainer trains on %s (it moves the "
                        "model there when it wraps it): kernels are chosen for %s", when, device, device)
        config = self.config
        if self.fp8 is not None:
            config = apply_fp8(load_config(config), self.fp8, manager,  # type: ignore[arg-type]
                               source=f"KernelizeCallback(fp8={self.fp8!r})")
        try:
            kernelize(target, mode=mode, device=device, config=config, strict=self.strict,  # type: ignore[arg-type]
                      plugin_manager=self.plugin_manager)
        except KernelizeError as exc:
            raise KernelizeError(f"KernelizeCallback: kernelize({type(target).__name__}, mode={mode}) failed {when}; "
                                 f"the model is unchanged: {exc}") from exc

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        # Before the Trainer (or TRL) wraps anything: kernels then sit inside accelerate's mixed-precision wrapper
        # and under TRL's fused LM head, which both keep calling the forward they found.
        if model is None:
            return
        target = _unwrap(model)
        why = weights_arrive_later(args, target)
        if why is not None:
            logger.info("KernelizeCallback: kernelizing when training begins, not when the Trainer is built: %s", why)
            return
        self._kernelize(args, target, "when the Trainer was built")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise KernelizeError("KernelizeCallback: the Trainer passed no model to on_train_begin")
        target = _unwrap(model)
        if get_report(target) is None:
            # A model made by model_init in train(), or a callback added after the Trainer was built: kernelize
            # what the Trainer has prepared (DDP and FSDP2 either way; compilation is lazy).
            self._kernelize(args, target, "when training began")
        _annotate_trl(target)
        self._optimizer(kwargs.get("optimizer"))
        report = get_report(target)
        self.report = report
        self.loss = loss_owner(target)
        if self.optimizer_step is not None:
            logger.info("KernelizeCallback: %s", self.optimizer_step)
        if report is None:
            return
        logger.info("%s; loss: %s", report.summary(), self.loss)
        if state is None or getattr(state, "is_world_process_zero", True):
            self._write(args, report)

    def _optimizer(self, optimizer: Any) -> None:
        """Under FSDP2, the Trainer's optimizer (inside accelerate's wrapper) steps on the local shards."""
        self.optimizer_step = None
        if self.local_shard_step is False:
            return
        if optimizer is None:
            if self.local_shard_step:
                raise KernelizeError("KernelizeCallback(local_shard_step=True): the Trainer passed no optimizer to "
                                     "on_train_begin")
            return
        problem = local_shard_problem(optimizer)  # of the optimizer inside accelerate's AcceleratedOptimizer
        if problem is None:
            self.optimizer_step = step_on_local_shards(optimizer).describe()
            return
        name = type(_inner(optimizer)).__name__
        if self.local_shard_step:
            raise KernelizeError(f"KernelizeCallback(local_shard_step=True): {name} cannot step on local shards: "
                                 f"{problem}")
        if problem != NO_DTENSOR:
            self.optimizer_step = f"{name} steps through DTensor dispatch: {problem}"

    def _write(self, args: Any, report: KernelizeReport) -> None:
        output_dir = getattr(args, "output_dir", None)
        if not output_dir:
            return
        path = Path(output_dir) / REPORT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"loss": self.loss, **({"optimizer": self.optimizer_step} if self.optimizer_step else {}),
                   **report.to_dict()}
        path.write_text(json.dumps(payload, indent=2) + "\n")
