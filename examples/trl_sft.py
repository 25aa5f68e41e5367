"""TRL's SFTTrainer with ``callbacks=[KernelizeCallback()]``, checked against the same trainer without it.

TRL computes the loss with its own fused LM head (per-token log-probabilities for its metrics); kernels-core
kernelizes the layers under it. Builds a small Qwen3 from a config and a word-level tokenizer in code (no
download), trains 20 steps each way from the same seed, prints the report and the loss owner, and exits non-zero
if any step's loss, token accuracy or entropy differs by more than 1e-3 relative. CPU, about a minute.

    python examples/trl_sft.py [--steps 20] [--output-dir /tmp/kernels-core-trl-sft]
"""

from __future__ import annotations

import argparse
import sys

import kernels_core
import torch
from datasets import Dataset
from kernels_core.integrations.transformers import KernelizeCallback
from tokenizers import Tokenizer
from tokenizers import models
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM
from transformers import PreTrainedTokenizerFast
from transformers import Qwen3Config
from trl import SFTConfig
from trl import SFTTrainer


VOCAB = 2048
KEYS = ("loss", "mean_token_accuracy", "entropy")


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def dataset(rows: int = 160) -> Dataset:
    g = torch.Generator().manual_seed(0)
    # Repeated phrases, so the model has something to learn and the token accuracy moves.
    phrases = [" ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (8,), generator=g)) for _ in range(12)]
    picks = torch.randint(0, len(phrases), (rows, 4), generator=g)
    return Dataset.from_list([{"text": " ".join(phrases[int(i)] for i in row)} for row in picks])


def train(callbacks: list, steps: int, output_dir: str) -> tuple[list[dict], torch.nn.Module]:
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    args = SFTConfig(output_dir=output_dir, per_device_train_batch_size=8, max_steps=steps, logging_steps=1,
                     learning_rate=2e-3, max_length=64, report_to=[], save_strategy="no", seed=0, use_cpu=True,
                     bf16=False, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(),
                         callbacks=callbacks)
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e], model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="/tmp/kernels-core-trl-sft")
    opts = parser.parse_args()
    plain, _ = train([], opts.steps, opts.output_dir + "/plain")
    callback = KernelizeCallback()
    fused, model = train([callback], opts.steps, opts.output_dir + "/kernelized")
    print(kernels_core.get_report(model))
    print(f"\nloss: {callback.loss}\n")
    print(f"{'step':>4}  " + "  ".join(f"{k + ' plain':>26}  {k + ' kernelized':>26}" for k in KEYS))
    worst = 0.0
    for step, (a, b) in enumerate(zip(plain, fused, strict=True), 1):
        print(f"{step:>4}  " + "  ".join(f"{a[k]:>26.6f}  {b[k]:>26.6f}" for k in KEYS))
        worst = max([worst] + [abs(b[k] - a[k]) / max(abs(a[k]), 1e-6) for k in KEYS])
    print(f"largest per-step relative difference: {worst:.2e} (limit 1e-3)")
    return 0 if worst <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
