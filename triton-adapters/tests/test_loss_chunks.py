"""The token-chunk size handed to Liger's fused linear cross-entropy (``kernels_triton._loss._chunk_mem_const``).

Liger 0.8.5 sizes its chunks as ``next_power_of_2(ceil(BT / ceil(V / (chunk_mem_const * H))))`` rows, capped at
BT. Eagerly the adapter passes 2 (a peak equal to Liger's own, measured); under torch.compile it picks
``chunk_mem_const`` so that this lands near 1024 rows whatever the model's width.
"""

from __future__ import annotations

import math

import pytest
from kernels_triton import _loss


def _liger_chunk_rows(n_tokens: int, vocab: int, hidden: int, chunk_mem_const: int) -> int:
    inc_factor = math.ceil(vocab / (chunk_mem_const * hidden))
    return min(1 << (math.ceil(n_tokens / inc_factor) - 1).bit_length(), n_tokens)


@pytest.mark.parametrize(("n_tokens", "vocab", "hidden"), [
    (8192, 151936, 1024),  # Qwen3-0.6B, batch 4 x 2048: Liger's default gives 64-row chunks
    (2048, 151936, 1024),
    (8192, 128256, 4096),  # Llama-3 8B
    (16384, 256000, 2304),  # Gemma-2 2B
    (8192, 49152, 576),  # SmolLM2-135M
])
def test_compiled_chunks_are_about_1024_rows(n_tokens, vocab, hidden):
    const = _loss._chunk_mem_const(n_tokens, vocab, hidden, compiling=True)
    rows = _liger_chunk_rows(n_tokens, vocab, hidden, const)
    assert 512 <= rows <= 1024
    assert rows >= _liger_chunk_rows(n_tokens, vocab, hidden, 1), "never smaller chunks than Liger's default"


@pytest.mark.parametrize(("n_tokens", "vocab", "hidden"), [(37, 101, 16), (1, 32000, 4096), (65536, 32000, 8192)])
def test_small_batches_take_one_chunk_and_large_ones_keep_the_default(n_tokens, vocab, hidden):
    const = _loss._chunk_mem_const(n_tokens, vocab, hidden, compiling=True)
    assert const >= 1
    rows = _liger_chunk_rows(n_tokens, vocab, hidden, const)
    assert rows == n_tokens or rows == _liger_chunk_rows(n_tokens, vocab, hidden, 1)


def test_eager_chunks_keep_twice_liger_default_budget():
    assert _loss._chunk_mem_const(8192, 151936, 1024, compiling=False) == 2
    assert _liger_chunk_rows(8192, 151936, 1024, 2) == 128
