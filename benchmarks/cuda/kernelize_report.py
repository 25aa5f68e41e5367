"""Print kernelize's report for a Qwen3-0.6B-shaped model on the GPU, per mode (diagnostic, not a test).

    python -m benchmarks.cuda.kernelize_report
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import QWEN3_0_6B
from benchmarks.common import causal_lm


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    import kernels_core

    print("backends:", kernels_core.detect_devices())
    # Two decoder layers hold every layer kind the report lists.
    model = causal_lm("qwen3", device="cuda", **{**QWEN3_0_6B, "num_hidden_layers": 2})
    for mode in (kernels_core.Mode.TRAINING, kernels_core.Mode.INFERENCE,
                 kernels_core.Mode.TRAINING | kernels_core.Mode.TORCH_COMPILE):
        kernels_core.kernelize(model, mode=mode)
        print(f"--- {mode}")
        print(kernels_core.get_report(model).table())
        kernels_core.unkernelize(model)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
