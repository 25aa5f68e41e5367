"""kernels-npu: Ascend NPU kernels for kernels-core, over torch_npu's fused operators.

Nothing is imported here: kernels-core finds the plugin through its ``kernels_core.plugins`` entry point
(:mod:`kernels_npu._plugin`), and kernels are loaded only when ``kernels_core.kernelize`` chooses them.

Example:
    >>> import kernels_npu
    >>> kernels_npu.__version__
    '0.1.0'
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
