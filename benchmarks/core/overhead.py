"""Cost of kernels-core itself: what discovery imports, and how long discovery and kernelize take.

    python -m benchmarks.core.overhead [--layers 28] [--out benchmarks/results/core-overhead-cpu.json]

Each measurement runs in a fresh subprocess so that import caches and the process-wide plugin manager start
cold. The model is a Qwen3-0.6B-shaped body (28 layers, hidden 1024) with a small vocabulary, built on the
meta device for the structure and materialised on the CPU, so kernelize's probes run on real tensors.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.common import write_json


HEAVY = ("torch", "transformers", "triton", "liger_kernel", "torch_npu")

DISCOVERY = r"""
import json, sys, time
t0 = time.perf_counter()
import kernels_core
t1 = time.perf_counter()
plugins = kernels_core.list_plugins()
kernels = kernels_core.list_kernels()
t2 = time.perf_counter()
impl_modules = sorted({spec.impl.split(":")[0] for spec, _ in kernels} & set(sys.modules))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY})
print(json.dumps({"import_s": t1 - t0, "discovery_s": t2 - t1, "plugins": [p.name for p in plugins],
                  "kernels": len(kernels), "kernel_modules_imported": impl_modules, "heavy_modules_imported": heavy}))
"""

KERNELIZE = r"""
import json, time, logging
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import kernels_core
config = AutoConfig.for_model("qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers={layers},
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=4096,
                              tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config)
t0 = time.perf_counter()
kernels_core.get_plugin_manager().kernels()
t1 = time.perf_counter()
kernels_core.kernelize(model, mode=kernels_core.Mode.TRAINING)
t2 = time.perf_counter()
kernels_core.kernelize(model, mode=kernels_core.Mode.TRAINING)
t3 = time.perf_counter()
kernels_core.unkernelize(model)
t4 = time.perf_counter()
report = kernels_core.get_report(model)
print(json.dumps({"discovery_s": t1 - t0, "kernelize_first_s": t2 - t1, "kernelize_again_s": t3 - t2,
                  "unkernelize_s": t4 - t3, "modules": sum(1 for _ in model.modules())}))
"""


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--out", type=Path, default=RESULTS / "core-overhead-cpu.json")
    args = parser.parse_args()
    import torch
    import transformers

    discovery = _run(DISCOVERY.replace("{HEAVY}", repr(set(HEAVY))))
    kernelize = _run(KERNELIZE.replace("{layers}", str(args.layers)))
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "layers": args.layers, "discovery": discovery, "kernelize": kernelize,
    }
    write_json(args.out, result)
    print(f"import kernels_core          {discovery['import_s'] * 1e3:8.1f} ms")
    print(f"discovery + listing          {discovery['discovery_s'] * 1e3:8.1f} ms  "
          f"({len(discovery['plugins'])} plugins, {discovery['kernels']} kernels)")
    print(f"kernel modules imported      {discovery['kernel_modules_imported'] or 'none'}")
    print(f"heavy modules imported       {discovery['heavy_modules_imported'] or 'none'}")
    print(f"kernelize, {args.layers} layers (first)  {kernelize['kernelize_first_s'] * 1e3:8.1f} ms")
    print(f"kernelize again (re-resolve) {kernelize['kernelize_again_s'] * 1e3:8.1f} ms")
    print(f"unkernelize                  {kernelize['unkernelize_s'] * 1e3:8.1f} ms")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
