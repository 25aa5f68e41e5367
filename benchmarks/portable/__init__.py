"""The core's portable kernels against eager PyTorch: training-step peak memory and time, on CPU or any GPU."""
