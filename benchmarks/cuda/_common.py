"""Shared helpers for the CUDA benchmarks: environment record, timing."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import pathlib

import torch


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def environment() -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "liger_kernel": version("liger-kernel"),
    }


def write_json(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def bench(fn, *, rep: int = 200) -> float:
    """Median microseconds of ``fn`` under ``triton.testing.do_bench`` (L2 flushed between calls, host included)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3
