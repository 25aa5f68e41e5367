"""Print kernelize's report for a Qwen3-0.6B-shaped model on the GPU, per mode (diagnostic, not a test).

    python benchmarks/cuda/kernelize_report.py
"""

from __future__ import annotations

import sys

import torch


def main() -> None:
    import kernels_core
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    print("backends:", kernels_core.detect_devices())
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    for mode in (kernels_core.Mode.TRAINING, kernels_core.Mode.INFERENCE,
                 kernels_core.Mode.TRAINING | kernels_core.Mode.TORCH_COMPILE):
        kernels_core.kernelize(model, mode=mode)
        print(f"--- {mode}")
        print(kernels_core.get_report(model).table())
        kernels_core.unkernelize(model)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
