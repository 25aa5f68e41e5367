"""Benchmarks on NVIDIA GPUs: kernels-cuda and kernels-triton against eager PyTorch, torch.compile and Liger-Kernel,
from single kernels to multi-GPU training."""
