"""Which AMD GPUs the installed torch can drive.

Only ROCm builds of torch count (``torch.version.hip`` set). Their GPUs report the torch device type ``cuda``
too, which is why the kernels-cuda plugin declines any build with ``torch.version.hip`` set and this one
declines every other build: exactly one of the two claims the ``cuda`` devices of a given torch.
"""

from __future__ import annotations

import logging
import re
from types import ModuleType

from kernels_core.plugin import BackendInfo
from kernels_core.plugin import DeviceInfo


__all__ = ["BACKEND", "DEVICE_TYPE", "PRIORITY", "detect_rocm", "gfx_arch"]

logger = logging.getLogger(__name__)

BACKEND = "rocm"
DEVICE_TYPE = "cuda"  # what ROCm tensors report: torch.device("cuda", i)
PRIORITY = 100

_GFX_RE = re.compile(r"^gfx[0-9a-f]+$")


def gfx_arch(gcn_arch_name: object) -> str | None:
    """The bare gfx name of a ``gcnArchName``, without target feature flags; None if it is not one.

    Example:
        >>> gfx_arch("gfx942:sramecc+:xnack-"), gfx_arch("gfx1100"), gfx_arch("")
        ('gfx942', 'gfx1100', None)
    """
    if not isinstance(gcn_arch_name, str):
        return None
    # Feature flags (":sramecc+", ":xnack-") select code-object variants, not a different instruction set.
    arch = gcn_arch_name.split(":", 1)[0].strip().lower()
    return arch if _GFX_RE.match(arch) else None


def _device(torch: ModuleType, index: int) -> DeviceInfo:
    cuda = torch.cuda
    props = cuda.get_device_properties(index)
    raw = getattr(props, "gcnArchName", None)
    arch = gfx_arch(raw)
    if arch is None:
        # Still reported: arch-constrained kernels then decline it with a reason, native kernels still apply.
        logger.debug("kernels-rocm: device %d reports no usable gcnArchName (%r)", index, raw)
    name = cuda.get_device_name(index) or getattr(props, "name", "") or f"AMD GPU {index}"
    return DeviceInfo(index=index, name=name, arch=arch)


def detect_rocm() -> list[BackendInfo]:
    """Report the AMD devices a ROCm build of torch sees; never raises.

    Returns an empty list when torch is missing or is not a ROCm build (CPU-only or CUDA), and a backend with no
    devices when a ROCm build finds no GPU or its driver cannot be queried. Each reason is logged at DEBUG.

    Example:
        >>> [info.backend for info in detect_rocm()] in ([], ["rocm"])
        True
    """
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - detection must never raise
        logger.debug("kernels-rocm: torch is not importable (%s); no ROCm backend", exc)
        return []
    hip = getattr(getattr(torch, "version", None), "hip", None)
    if not hip:
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        why = f"a CUDA build (CUDA {cuda}); its GPUs belong to kernels-cuda" if cuda else "not a ROCm build"
        logger.debug("kernels-rocm: torch %s is %s; no ROCm backend", getattr(torch, "__version__", "?"), why)
        return []
    devices: list[DeviceInfo] = []
    try:
        if torch.cuda.is_available():
            devices = [_device(torch, index) for index in range(torch.cuda.device_count())]
    except Exception as exc:  # noqa: BLE001 - a broken driver means no devices, not a crash
        logger.debug("kernels-rocm: ROCm build (HIP %s) but querying devices failed (%s)", hip, exc)
        devices = []
    if not devices:
        logger.debug("kernels-rocm: ROCm build (HIP %s) sees no GPU", hip)
    return [BackendInfo(backend=BACKEND, device_type=DEVICE_TYPE, devices=tuple(devices), priority=PRIORITY,
                        runtime=f"ROCm (HIP {hip})")]
