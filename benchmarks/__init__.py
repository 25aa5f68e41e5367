"""The benchmarks of kernels-core and its plugins, run from the repository root as modules.

    python -m benchmarks.core.overhead                                   # the core's own cost, CPU
    python -m benchmarks.portable.memory                                 # portable kernels against eager, CPU
    python -m benchmarks.cuda.models_bench --out /tmp/models.json        # an NVIDIA GPU
    torchrun --nproc_per_node 2 -m benchmarks.cuda.distributed_bench --out /tmp/x.json --device cpu --tiny

``benchmarks.common`` holds what they share; each benchmark's docstring says what it measures and how to run it.
Results go to ``benchmarks/results/``, from which ``python -m tools.report --write`` makes the README's table and
the documentation's benchmarks page.
"""
