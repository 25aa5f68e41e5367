"""What binds, resolved for an H200 with kernels-cuda (simulated: resolution only, on the CPU), for the families
whose loss, residual add + norm or rotary kernels used to be declined by the shape of their source.

Each family is built tiny from its configuration's defaults, as ``python -m tools.family_table`` (which writes
``docs/families.md`` for every family) builds it; ``core/tests/kinds/test_family_sweep.py`` checks the same
families' loss and gradients against eager. Here: the kernel each kind gets on a Hopper GPU, and that a kind left
alone names what differs.
"""

from __future__ import annotations

import pytest


pytest.importorskip("transformers")
family_table = pytest.importorskip("tools.family_table", reason="needs the repository root on sys.path")

LOSS, RESIDUAL, ROTARY = "causal_lm_loss", "residual_rms_norm", "rotary_embedding"
# family -> the kinds that must get a CUDA kernel (MoE output classes, multipliers, sandwich norms, MLA, pair-wise
# rotary, logit scales).
EXPECTED = {
    "granite": (LOSS, RESIDUAL, ROTARY),
    "granitemoe": (LOSS, RESIDUAL, ROTARY),
    "gemma3_text": (LOSS, RESIDUAL, ROTARY),
    "glm4": (LOSS, RESIDUAL, ROTARY),
    "deepseek_v3": (LOSS, RESIDUAL, ROTARY),
    "minicpm3": (LOSS, RESIDUAL, ROTARY),
    "glm4_moe": (LOSS, RESIDUAL, ROTARY),
    "exaone_moe": (LOSS,),
    "jetmoe": (LOSS, ROTARY),
    "afmoe": (LOSS, RESIDUAL, ROTARY),
    "ernie4_5": (LOSS, RESIDUAL, ROTARY),
    "helium": (LOSS, RESIDUAL, ROTARY),
    "cohere": (LOSS,),
    # The layouts added since: VaultGemma's norm, DeepSeek-V2 / V3.2's probes (complex rotary, explicit mask),
    # Phi-3 / Emu3 residual dropout, Granite-MoE-Shared, gpt-oss's tuple-returning MLP; Flint's sliding layers.
    "vaultgemma": (LOSS, RESIDUAL, ROTARY),
    "deepseek_v2": (LOSS, RESIDUAL),
    "deepseek_v32": (LOSS, RESIDUAL, ROTARY),
    "phi3": (LOSS, RESIDUAL, ROTARY),
    "emu3": (LOSS, RESIDUAL, ROTARY),
    "granitemoeshared": (LOSS, RESIDUAL, ROTARY),
    "gpt_oss": (LOSS, RESIDUAL, ROTARY),
    "flint": (LOSS, RESIDUAL, ROTARY),
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_family_gets_cuda_kernels(family):
    row = family_table.family_row(family)
    if "error" in row:
        pytest.skip(f"{family}: {row['error']}")
    for kind in EXPECTED[family]:
        cell = row.get(kind)
        assert cell and cell["kernel"] and cell["kernel"].startswith("cuda."), f"{family} {kind}: {cell}"
    for kind in family_table.KINDS:
        cell = row.get(kind)
        assert cell is None or cell["kernel"] or cell["reason"], f"{family} {kind}: declined without a reason"


def test_the_gpu_tests_expect_what_resolution_gives():
    """test_families_gpu.py's cases expect a CUDA kernel of a variant per kind: resolved here first, on the CPU, so
    a GPU run fails only on numbers."""
    import test_families_gpu

    for case, (family, overrides, expected) in sorted(test_families_gpu.CASES.items()):
        row = family_table.family_row(family, **overrides)
        assert "error" not in row, f"{case}: {row['error']}"
        for kind, variant in expected.items():
            cell = row.get(kind) or {}
            assert (cell.get("kernel") or "").startswith("cuda.") and cell.get("variant") == variant, (
                f"{case} {kind}: {cell}")
