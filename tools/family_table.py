"""What binds per transformers causal-LM family, resolved for an H200 with kernels-cuda installed, on the CPU.

Every model type in transformers' causal-LM mapping is built from its configuration's defaults shrunk to two small
layers (``kernels_core.testing.tiny_family_causal_lm``) and kernelized for training against a simulated Hopper
device (a detection plugin reporting one capability-9.0 CUDA device): resolution only, nothing runs on a GPU. The
modern decoders (an RMSNorm and a rotary embedding) are tabulated per kind: the kernel bound, or the reason the
matcher gave. ``plugins-cuda/tests/test_family_coverage.py`` asserts the same resolution per family.

    python -m tools.family_table --write docs/families.md       # about 15 minutes on two cores
    python -m tools.family_table --json out.json qwen3 granite  # some families only

Each family runs in a process of its own (a family whose defaults are still large cannot take the others down).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import types
import warnings
from typing import Any


__all__ = ["KINDS", "family_row", "simulated_h200_manager"]

# The kinds tabulated: those that carry most of a training step's speed and memory.
KINDS = ("causal_lm_loss", "residual_rms_norm", "rotary_embedding", "silu_gated_mlp")
_TITLES = {"causal_lm_loss": "fused loss", "residual_rms_norm": "residual add + norm",
           "rotary_embedding": "rotary", "silu_gated_mlp": "SwiGLU MLP"}


def simulated_h200_manager() -> Any:
    """A plugin manager with kernels-cuda and a detection plugin reporting one H200 (capability 9.0)."""
    from importlib.metadata import entry_points

    from kernels_core import BackendInfo
    from kernels_core import DeviceInfo
    from kernels_core import hookimpl
    from kernels_core.testing import fresh_plugin_manager

    # kernels-cuda as kernels-core finds it: through its entry point.
    cuda_plugin = next(e for e in entry_points(group="kernels_core.plugins") if e.name == "cuda").load()

    detect = types.ModuleType("simulated_h200")
    detect.kernels_core_detect_devices = hookimpl(  # type: ignore[attr-defined]
        lambda: [BackendInfo("cuda", "cuda", (DeviceInfo(0, "simulated H200", capability=(9, 0)),), priority=100)])
    return fresh_plugin_manager((cuda_plugin, "cuda"), (detect, "simulated_h200"))


def is_modern_decoder(model: Any) -> bool:
    """Whether a model has an RMSNorm and a rotary embedding (the issue's "modern decoders")."""
    modules = list(model.modules())
    return (any("RMSNorm" in type(m).__name__ for m in modules)
            and any(name.endswith("inv_freq") for m in modules for name in m._buffers))


def family_row(model_type: str, **overrides: Any) -> dict[str, Any]:
    """``{"family", "modern", kind: {"kernel", "variant", "reason"}}`` for one model type, or ``{"family", "error"}``.

    A kind the model has no module of is absent; a kind bound on some modules only counts as bound (``partial``
    names how many). ``overrides`` are configuration settings for ``tiny_family_causal_lm``.
    """
    import kernels_core
    from kernels_core import Mode
    from kernels_core.testing import tiny_family_causal_lm

    row: dict[str, Any] = {"family": model_type}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = tiny_family_causal_lm(model_type, **overrides)
        except Exception as exc:  # noqa: BLE001 - a family this transformers cannot build tiny
            return {**row, "error": f"cannot be built from a tiny config: {type(exc).__name__}: {exc}"[:300]}
        row["modern"] = is_modern_decoder(model)
        try:
            kernels_core.kernelize(model, mode=Mode.TRAINING, device="cuda", plugin_manager=simulated_h200_manager())
        except Exception as exc:  # noqa: BLE001
            return {**row, "error": f"kernelize raised {type(exc).__name__}: {exc}"[:300]}
    entries = kernels_core.get_report(model).entries
    for kind in KINDS:
        rows = [e for e in entries if e.kind == kind]
        if not rows:
            continue
        bound = [e for e in rows if e.kernel]
        cell: dict[str, Any] = {"kernel": bound[0].kernel if bound else None,
                                "variant": bound[0].variant if bound else None,
                                "reason": None if bound else next((e.reason for e in rows if e.reason), "")}
        if bound and len(bound) < len(rows):
            cell["partial"] = f"{len(bound)}/{len(rows)}"
        row[kind] = cell
    return row


def _run_isolated(model_type: str) -> dict[str, Any]:
    try:
        done = subprocess.run([sys.executable, "-m", "tools.family_table", "--one", model_type], capture_output=True,
                              text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        return {"family": model_type, "error": "timed out"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"family": model_type, "error": done.stderr[-300:]}


def _cell(row: dict[str, Any], kind: str) -> str:
    cell = row.get(kind)
    if cell is None:
        return "-"
    if cell["kernel"]:
        text = f"`{cell['kernel']}` ({cell['variant']})"
        return text + (f", {cell['partial']} modules" if "partial" in cell else "")
    return "declined: " + " ".join((cell["reason"] or "").split()).replace("|", "/")


def render(rows: list[dict[str, Any]]) -> str:
    """The markdown page: counts per kind over the modern decoders, then one row per family.

    Example:
        >>> rotary = {"kernel": "cuda.rotary_embedding.triton", "variant": "full", "reason": None}
        >>> page = render([{"family": "qwen3", "modern": True, "rotary_embedding": rotary}])
        >>> "| qwen3 | - | - | `cuda.rotary_embedding.triton` (full) | - |" in page
        True
    """
    modern = [r for r in rows if r.get("modern")]
    counts = ", ".join(f"{_TITLES[k]} {sum(1 for r in modern if (r.get(k) or {}).get('kernel'))}" for k in KINDS)
    lines = [
        "# Families",
        "",
        "What `kernelize(model, mode=Mode.TRAINING)` binds for every causal-LM model type transformers ships that",
        "has an RMSNorm and a rotary embedding, resolved for one H200 with kernels-cuda installed. Each family is",
        "built from its configuration's defaults shrunk to two small layers; resolution runs on the CPU against a",
        "simulated device. A declined kind names the math that differs. Generated by",
        "`python -m tools.family_table --write docs/families.md`; `plugins-cuda/tests/test_family_coverage.py` checks",
        "the same resolution, and `core/tests/kinds/test_family_sweep.py` checks each family's loss and gradients",
        "against eager on the CPU.",
        "",
        f"Bound, of {len(modern)} modern decoders: {counts}.",
        "",
        "| family | " + " | ".join(_TITLES[k] for k in KINDS) + " |",
        "|---|" + "---|" * len(KINDS),
    ]
    lines += [f"| {r['family']} | " + " | ".join(_cell(r, k) for k in KINDS) + " |" for r in modern]
    others = sorted(r["family"] for r in rows if r.get("error"))
    if others:
        lines += ["", f"Not built here ({len(others)}): {', '.join(others)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: transformers' causal-LM mapping)")
    parser.add_argument("--one", help="resolve one family in this process and print its row as JSON")
    parser.add_argument("--write", help="write the markdown table here")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(family_row(args.one)))
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = args.families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(_run_isolated, families))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    page = render(rows)
    if args.write:
        with open(args.write, "w") as out:
            out.write(page)
    else:
        print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
