"""``any.sliding_window_attention.banded``: query blocks over the keys their window reaches, same attention.

Compared with transformers' own ``sdpa_attention_forward`` on the whole square, forward and backward, on odd
lengths and windows, grouped-query heads, padded sequences and additive masks; a counting stand-in checks that
the blocks really are split (or that the call goes through whole where it cannot be).
"""

from __future__ import annotations

import pytest
import torch
from kernels_core._portable._sliding_window import banded_sdpa
from kernels_core.testing import assert_close


sdpa_attention = pytest.importorskip("transformers.integrations.sdpa_attention")


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _band(length: int, window: int, *, pad: int = 0) -> torch.Tensor:
    i = torch.arange(length)
    band = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
    mask = band[None, None].repeat(2, 1, 1, 1)
    mask[0, :, :, :pad] = False
    mask[0, :, :pad, 0] = True  # padded queries keep one key, as transformers' sdpa masks do
    return mask


class _Counting:
    def __init__(self) -> None:
        self.query_lengths: list[int] = []

    def __call__(self, module, query, *args, **kwargs):
        self.query_lengths.append(query.shape[-2])
        return sdpa_attention.sdpa_attention_forward(module, query, *args, **kwargs)


def _qkv(length: int, heads: int, kv_heads: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(length)
    shapes = [(2, heads, length, 12), (2, kv_heads, length, 12), (2, kv_heads, length, 12)]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("length", "window", "heads", "kv_heads", "pad"), [
    (17, 3, 4, 2, 0),  # six blocks, the last one 2 queries long; grouped-query heads
    (23, 5, 3, 3, 4),  # padded first sequence
    (10, 3, 2, 1, 1),  # four blocks, one key/value head
])
def test_blocks_match_the_whole_square(dtype, length, window, heads, kv_heads, pad):
    module = _Attention(heads // kv_heads)
    mask = _band(length, window, pad=pad)
    q, k, v = _qkv(length, heads, kv_heads, dtype)
    counting = _Counting()
    out, weights = banded_sdpa(counting, module, q, k, v, mask, scaling=0.3, sliding_window=window)
    assert weights is None
    assert counting.query_lengths == [min(window, length - s) for s in range(0, length, window)]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, sliding_window=window)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    # Blocks change only the order of the softmax's sums; the dtype's own rounding bound holds.
    assert_close(out, ref, dtype=dtype, what="output")
    for name, a, e in zip("qkv", got, expected, strict=True):
        assert_close(a, e, dtype=dtype, what=f"grad {name}")


def test_additive_float_mask():
    length, window = 13, 4
    mask = torch.zeros(1, 1, length, length).masked_fill(~_band(length, window)[:1], float("-inf"))
    q, k, v = _qkv(length, 2, 2, torch.float32)
    module = _Attention(1)
    out, _ = banded_sdpa(sdpa_attention.sdpa_attention_forward, module, q, k, v, mask, sliding_window=window)
    ref, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, sliding_window=window)
    assert_close(out, ref, dtype=torch.float32)


@pytest.mark.parametrize("case", ["decode", "no_mask", "short", "no_window"])
def test_calls_it_cannot_split_go_through_whole(case):
    length, window = 12, 4
    q, k, v = _qkv(length, 2, 2, torch.float32)
    mask = _band(length, window)
    if case == "decode":
        q, mask = q[:, :, -1:], mask[:, :, -1:]
    elif case == "no_mask":
        mask = None
    elif case == "short":
        q, k, v, mask = q[:, :, :8], k[:, :, :8], v[:, :, :8], mask[:, :, :8, :8]
    counting = _Counting()
    module = _Attention(1)
    out, _ = banded_sdpa(counting, module, q, k, v, mask, sliding_window=None if case == "no_window" else window)
    assert counting.query_lengths == [q.shape[-2]]
    ref, _ = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, sliding_window=window)
    assert torch.equal(out, ref)


def test_compiles_without_graph_breaks():
    length, window = 19, 4
    q, k, v = _qkv(length, 4, 2, torch.float32)
    module, mask = _Attention(2), _band(length, window, pad=3)

    def run(q, k, v, mask):
        return banded_sdpa(sdpa_attention.sdpa_attention_forward, module, q, k, v, mask, sliding_window=window)[0]

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    assert_close(compiled, run(q, k, v, mask), dtype=torch.float32)
