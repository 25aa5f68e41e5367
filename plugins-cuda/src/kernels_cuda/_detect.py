"""Which NVIDIA GPUs the installed torch can drive.

Only CUDA builds of torch count: a ROCm build also reports its GPUs under the torch device type ``cuda``, but
those belong to the kernels-rocm plugin, so this module never claims them.
"""

from __future__ import annotations

import logging

from kernels_core.plugin import BackendInfo
from kernels_core.plugin import DeviceInfo


__all__ = ["BACKEND", "PRIORITY", "detect_cuda"]

logger = logging.getLogger(__name__)

BACKEND = "cuda"
PRIORITY = 100


def detect_cuda() -> list[BackendInfo]:
    """Report the NVIDIA devices a CUDA build of torch sees; never raises.

    Returns an empty list when torch is missing or is not a CUDA build (CPU-only or ROCm), and a backend with
    no devices when a CUDA build finds no GPU. Each reason is logged at DEBUG.

    Example:
        >>> [info.backend for info in detect_cuda()] in ([], ["cuda"])
        True
    """
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - detection must never raise
        logger.debug("kernels-cuda: torch is not importable (%s); no CUDA backend", exc)
        return []
    version = getattr(torch, "version", None)
    if getattr(version, "hip", None):
        logger.debug("kernels-cuda: torch is a ROCm build (hip %s); its GPUs belong to kernels-rocm", version.hip)
        return []
    cuda = getattr(version, "cuda", None)
    if not cuda:
        logger.debug("kernels-cuda: torch %s is not a CUDA build; no CUDA backend", torch.__version__)
        return []
    devices: list[DeviceInfo] = []
    try:
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            devices.append(DeviceInfo(index=index, name=torch.cuda.get_device_name(index), capability=(major, minor)))
    except Exception as exc:  # noqa: BLE001 - a broken driver means no devices, not a crash
        logger.debug("kernels-cuda: CUDA build %s but querying devices failed (%s)", cuda, exc)
        devices = []
    if not devices:
        logger.debug("kernels-cuda: CUDA build %s sees no GPU", cuda)
    return [BackendInfo(backend=BACKEND, device_type="cuda", devices=tuple(devices), priority=PRIORITY,
                        runtime=f"CUDA {cuda}")]
