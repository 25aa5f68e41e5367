"""The token-chunk size handed to Liger's fused linear cross-entropy (``kernels_triton._loss._chunk_mem_const``).

Liger 0.8.5 sizes its chunks as ``next_power_of_2(ceil(BT / ceil(V / (chunk_mem_const * H))))`` rows, capped at
BT. The adapter picks ``chunk_mem_const`` so that this lands near ``_CHUNK_ROWS`` (2048) rows whatever the model's
width and vocabulary, in every mode; ``KERNELS_TRITON_LOSS_CHUNK_ROWS`` overrides that target for a process.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
from kernels_triton import _loss


def _liger_chunk_rows(n_tokens: int, vocab: int, hidden: int, chunk_mem_const: int) -> int:
    inc_factor = math.ceil(vocab / (chunk_mem_const * hidden))
    return min(1 << (math.ceil(n_tokens / inc_factor) - 1).bit_length(), n_tokens)


@pytest.mark.parametrize(("n_tokens", "vocab", "hidden"), [
    (8192, 151936, 1024),  # Qwen3-0.6B, batch 4 x 2048: Liger's default gives 64-row chunks
    (8192, 262208, 2560),  # Gemma-3-4B, 2 x 4096
    (8192, 151936, 2048),  # Qwen3-30B-A3B
    (8192, 128256, 4096),  # Llama-3 8B
    (16384, 256000, 2304),  # Gemma-2 2B
    (8192, 49152, 576),  # SmolLM2-135M
])
def test_chunks_are_about_2048_rows(n_tokens, vocab, hidden):
    rows = _liger_chunk_rows(n_tokens, vocab, hidden, _loss._chunk_mem_const(n_tokens, vocab, hidden))
    assert 1024 < rows <= 2048
    assert rows >= _liger_chunk_rows(n_tokens, vocab, hidden, 1), "never smaller chunks than Liger's default"


@pytest.mark.parametrize(("n_tokens", "vocab", "hidden"), [(37, 101, 16), (1, 32000, 4096), (2048, 151936, 1024)])
def test_batches_up_to_the_target_take_one_chunk(n_tokens, vocab, hidden):
    const = _loss._chunk_mem_const(n_tokens, vocab, hidden)
    assert const >= 1
    assert _liger_chunk_rows(n_tokens, vocab, hidden, const) == n_tokens


def test_huge_batches_keep_at_least_liger_default():
    # Far more tokens than the vocabulary: the formula's budget falls below 1 and Liger's default applies.
    assert _loss._chunk_mem_const(1 << 22, 32000, 8192) == 1


@pytest.mark.parametrize(("n_tokens", "vocab", "hidden"), [(8192, 151936, 1024), (8192, 262208, 2560), (37, 101, 16),
                                                           (2049, 151936, 1024), (256, 1024, 16)])
def test_chunk_count_follows_liger(n_tokens, vocab, hidden):
    # The adapter asks Liger for float32 accumulation exactly when Liger will take more than one chunk.
    const = _loss._chunk_mem_const(n_tokens, vocab, hidden)
    rows = _liger_chunk_rows(n_tokens, vocab, hidden, const)
    assert _loss._liger_chunks(n_tokens, vocab, hidden, const) == math.ceil(n_tokens / rows)


def test_chunk_rows_default_and_override(monkeypatch):
    # The benchmarks' chunk<N> variants set KERNELS_TRITON_LOSS_CHUNK_ROWS before the loss is loaded.
    monkeypatch.delenv(_loss.CHUNK_ROWS_ENV, raising=False)
    assert _loss._chunk_rows_setting() == 2048
    monkeypatch.setenv(_loss.CHUNK_ROWS_ENV, "512")
    assert _loss._chunk_rows_setting() == 512
    shape = (8192, 151936, 1024)
    default = _liger_chunk_rows(*shape, _loss._chunk_mem_const(*shape))
    with mock.patch.object(_loss, "_CHUNK_ROWS", 512):
        rows = _liger_chunk_rows(*shape, _loss._chunk_mem_const(*shape))
    assert 512 <= rows <= 1024 < default, "Liger takes chunks of about the rows asked for"


@pytest.mark.parametrize("value", ["0", "-4", "2k", "1.5"])
def test_a_chunk_rows_override_that_is_no_positive_integer_raises(monkeypatch, value):
    # An explicit request that cannot be honoured: loading the loss fails (kernelize then falls back, saying why).
    monkeypatch.setenv(_loss.CHUNK_ROWS_ENV, value)
    with pytest.raises(ValueError, match=f"KERNELS_TRITON_LOSS_CHUNK_ROWS={value!r}: expected a positive number"):
        _loss._chunk_rows_setting()
