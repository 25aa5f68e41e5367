"""The floor accounting of ``benchmarks/cuda/floor.py``: what a step is made of, counted from a config.

Its timings are only worth reading on a GPU; here the enumeration is checked against the textbook count (6 FLOPs per
parameter and token for a linear layer's three products, the decoder layers' forward once more with activation
checkpointing), with a stand-in timer, and one real CPU timing runs end to end.
"""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest
import torch


REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (REPO / "benchmarks" / "cuda" / "floor.py").is_file(),
                                reason="needs the source repository's benchmarks/")


def _floor():
    # By name, as test_benchmarks_layout does: benchmarks/ is the repository's own folder, no distribution.
    return importlib.import_module("benchmarks.cuda.floor")


def _config(**overrides):
    sizes = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=320, tie_word_embeddings=False)
    return types.SimpleNamespace(**{**sizes, **overrides})


class FlopTimer:
    """Charges 1 ms per GFLOP of a product, nothing else: the GEMM total is then the step's GEMM FLOPs."""

    def gemm_ms(self, m, n, k, precision):
        return 2 * m * n * k / 1e9

    def attention_ms(self, *shape):
        return 0.0, 0.0

    def bandwidth_GBps(self):
        return 1.0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gemms_are_three_products_per_linear(checkpointing):
    floor = _floor()

    config, tokens = _config(), 2 * 48
    shape = floor.shape_of(config)
    layer = sum(k * n for _, k, n in shape.linears())
    head = config.hidden_size * config.vocab_size
    # Per parameter and token: 2 FLOPs forward (twice with checkpointing), 2 per gradient product.
    expected = (2 * (2 if checkpointing else 1) + 4) * layer * shape.layers * tokens + 6 * head * tokens
    result = floor.step_floor(config, batch=2, seq=48, timer=FlopTimer(), checkpointing=checkpointing)
    assert sum(2 * g["m"] * g["n"] * g["k"] * g["count"] for g in result["gemms"]) == expected
    assert result["breakdown_ms"]["gemm"] == pytest.approx(expected / 1e9, abs=1e-3)


def test_fp8_covers_the_projections_and_lm_head_only_when_asked():
    floor = _floor()

    def precisions(**options):
        """(the projections' precisions, lm_head's): lm_head's products are those with a side of vocab size."""
        gemms = floor.step_floor(_config(), batch=1, seq=32, timer=FlopTimer(), **options)["gemms"]
        head = {g["precision"] for g in gemms if 320 in (g["m"], g["n"], g["k"])}
        return {g["precision"] for g in gemms if 320 not in (g["m"], g["n"], g["k"])}, head

    assert precisions(fp8="rowwise") == ({"rowwise"}, {"bf16"})
    assert precisions(fp8="rowwise", lm_head_fp8=True) == ({"rowwise"}, {"rowwise"})
    assert precisions() == ({"bf16"}, {"bf16"})


def test_windows_and_moe():
    floor = _floor()

    gemma = _config(model_type="gemma3_text", layer_types=["sliding_attention", "full_attention"],
                    sliding_window=16, num_hidden_layers=2)
    shape = floor.shape_of(gemma)
    assert shape.windows == (16, None) and shape.qk_norm and shape.norms_per_layer == 4
    moe = floor.step_floor(_config(num_experts=8), batch=1, seq=32, timer=FlopTimer())
    assert moe["floor_ms"] is None and "MoE" in moe["not_modelled"]


def test_a_cpu_floor_runs_end_to_end():
    floor = _floor()

    timer = floor.PartTimer(torch.device("cpu"), repeats=1, target_ms=1.0)
    result = floor.step_floor(_config(), batch=1, seq=32, timer=timer,
                              comm=lambda parameters: (0.5, 0.25), layers_per_unit=2)
    assert result["floor_ms"] > 0 and result["breakdown_ms"]["communication_exposed"] >= 0.75
    row = {"step_ms": 2 * result["floor_ms"]}
    floor.attach(row, result)
    assert row["floor_fraction"] == pytest.approx(0.5, abs=1e-3)
