"""LLaMA-Factory v1 SFT with and without kernels-core, on the CPU, from a tiny model written here (no downloads).

    pip install "./core[llamafactory]"   # or the pinned set of noxfile.py's llamafactory session
    python examples/llamafactory_v1.py [--steps 6]

Runs examples/llamafactory_v1.yaml through LLaMA-Factory v1's own SFT steps (arguments, data engine, model
engine, trainer) twice from the same seed: with its ``kernel_config`` (``name: kernels_core``) and with no
``kernel_config``. Prints the kernelize report of the model LLaMA-Factory loaded and both loss curves, and exits
non-zero if the losses differ by more than float32 reduction-order noise.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf


HERE = Path(__file__).resolve().parent
# fp32 kernels reduce in another order than eager; after a few optimizer steps at lr 1e-3 the losses of a
# 64-wide model drift by about 1e-6 relative, so 1e-4 is far above noise and far below a wrong kernel.
RELATIVE_TOLERANCE = 1e-4


def train(args: dict) -> tuple[list[float], object]:
    """LLaMA-Factory v1's run_sft, keeping the trainer so its model and log history can be read."""
    from llamafactory.v1.accelerator.interface import DistributedInterface
    from llamafactory.v1.config import get_args
    from llamafactory.v1.core.data_engine import DataEngine
    from llamafactory.v1.core.model_engine import ModelEngine
    from llamafactory.v1.trainers.sft_trainer import SFTTrainer

    model_args, data_args, training_args, _ = get_args(args)
    DistributedInterface(training_args.dist_config)
    dataset = DataEngine(data_args.train_dataset)
    engine = ModelEngine(model_args, is_train=True)
    trainer = SFTTrainer(args=training_args, model=engine.model, renderer=engine.renderer, train_dataset=dataset)
    trainer.fit()
    return [entry["loss"] for entry in trainer.state.log_history], engine.model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the yaml's max_steps)")
    options = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import kernels_core
    import kernels_core.integrations.llamafactory  # noqa: F401  (registers KernelPlugin("kernels_core"))
    from kernels_core.testing import save_tiny_chat_model
    from kernels_core.testing import write_tiny_sft_dataset

    config = OmegaConf.to_container(OmegaConf.load(HERE / "llamafactory_v1.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config["model"] = str(save_tiny_chat_model(work / "tiny-qwen3"))
        config["train_dataset"] = str(write_tiny_sft_dataset(work / "tiny-sft.jsonl", count=48))
        if options.steps is not None:
            config["max_steps"] = options.steps
        kernel_losses, model = train({**config, "output_dir": str(work / "kernels")})
        print(kernels_core.get_report(model))
        eager_losses, _ = train({**{k: v for k, v in config.items() if k != "kernel_config"},
                                 "output_dir": str(work / "eager")})

    print(f"\n{'step':>4}  {'eager loss':>12}  {'kernels-core':>12}  {'rel. diff':>9}")
    worst = 0.0
    for step, (eager, kernel) in enumerate(zip(eager_losses, kernel_losses, strict=True), start=1):
        diff = abs(kernel - eager) / abs(eager)
        worst = max(worst, diff) if math.isfinite(diff) else math.inf
        print(f"{step:>4}  {eager:>12.6f}  {kernel:>12.6f}  {diff:>9.1e}")
    ok = worst <= RELATIVE_TOLERANCE and len(eager_losses) > 0
    print(f"\nlosses {'agree' if ok else 'DIFFER'}: worst relative difference {worst:.1e} "
          f"(tolerance {RELATIVE_TOLERANCE:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
