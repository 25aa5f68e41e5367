"""A tiny chat model, tokenizer and SFT data set written from code, for LLaMA-Factory runs without downloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


__all__ = ["CHAT_TOKENS", "save_tiny_chat_model", "write_tiny_sft_dataset"]

# LLaMA-Factory v1's ``chatml`` template writes these markers around every message.
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_WORDS = ("the quick brown fox jumps over a lazy dog while kernels fuse norms and rotary embeddings into one pass "
          "user assistant system hello what is two plus three five seven eleven thirteen red green blue").split()


def _conversations(count: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(count):
        question = " ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(5 + i % 4))
        answer = " ".join(_WORDS[(i * 11 + 3 * j) % len(_WORDS)] for j in range(6 + i % 5))
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "text", "value": question}], "loss_weight": 0.0},
            {"role": "assistant", "content": [{"type": "text", "value": answer}], "loss_weight": 1.0},
        ]})
    return rows


def save_tiny_chat_model(directory: str | Path, *, model_type: str = "qwen3", seed: int = 0,
                         **config_overrides: Any) -> Path:
    """Write a randomly initialised ``model_type`` causal LM and a byte-level BPE tokenizer to ``directory``.

    The tokenizer is trained here on a few sentences (about 300 tokens, ``chatml`` markers included), so
    ``AutoProcessor`` / ``AutoModelForCausalLM.from_pretrained(directory)`` work offline.
    """
    import torch
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(CHAT_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(_WORDS)] + [m["content"][0]["value"] for row in _conversations(64) for m in row["messages"]]
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None, unk_token=None)
    tokenizer.save_pretrained(directory)
    settings: dict[str, Any] = {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": len(tokenizer), "max_position_embeddings": 256,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    settings.update(config_overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def write_tiny_sft_dataset(path: str | Path, *, count: int = 32) -> Path:
    """Write ``count`` two-turn conversations in LLaMA-Factory v1's message format as JSON lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in _conversations(count)))
    return path
