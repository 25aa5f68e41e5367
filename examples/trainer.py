"""transformers' Trainer with one extra line, ``callbacks=[KernelizeCallback()]``, checked against the plain Trainer.

Builds a small Qwen3 from a config (no download), a token dataset in code, trains 20 steps plain and 20 steps
with the callback from the same seed, prints the kernelize report and exits non-zero if any step's loss differs
by more than 1e-3 relative. CPU, about a minute.

    python examples/trainer.py [--steps 20] [--output-dir /tmp/kernels-core-trainer]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kernels_core
import torch
from kernels_core.integrations.transformers import KernelizeCallback
from transformers import AutoModelForCausalLM
from transformers import Qwen3Config
from transformers import Trainer
from transformers import TrainingArguments


def build_model() -> torch.nn.Module:
    config = Qwen3Config(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def dataset(rows: int = 160, length: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rows):
        ids = torch.randint(3, 4096, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def train(callbacks: list, steps: int, output_dir: str) -> tuple[list[float], torch.nn.Module]:
    model = build_model()
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, max_steps=steps, logging_steps=1,
                             learning_rate=1e-3, report_to=[], save_strategy="no", seed=0, use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="/tmp/kernels-core-trainer")
    opts = parser.parse_args()
    plain, _ = train([], opts.steps, opts.output_dir + "/plain")
    fused, model = train([KernelizeCallback()], opts.steps, opts.output_dir + "/kernelized")
    print(kernels_core.get_report(model))
    written = json.loads((Path(opts.output_dir) / "kernelized" / "kernelize_report.json").read_text())
    print(f"\nloss: {written['loss']}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(fused, plain, strict=True))
    print(f"\n{'step':>4}  {'plain':>10}  {'kernelized':>10}")
    for step, (a, b) in enumerate(zip(plain, fused, strict=True), 1):
        print(f"{step:>4}  {a:>10.6f}  {b:>10.6f}")
    print(f"largest per-step relative difference: {worst:.2e} (limit 1e-3)")
    return 0 if worst <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
