"""Ascend NPU detection: which NPUs this process can drive, without ever raising.

"No NPU" has many causes (no torch_npu, torch_npu failing to import, no device, a driver error while counting);
all of them produce a :class:`~kernels_core.plugin.BackendInfo` with no devices and a DEBUG log line saying why, so the
core can report the NPU kernels as unavailable with a reason instead of failing discovery.
"""

from __future__ import annotations

import logging
from typing import Any

from kernels_core.plugin import BackendInfo
from kernels_core.plugin import DeviceInfo

from ._torch_npu import load_torch_npu


__all__ = ["BACKEND", "DEVICE_TYPE", "PRIORITY", "detect_npu"]

logger = logging.getLogger(__name__)

BACKEND = "npu"
DEVICE_TYPE = "npu"
# Vendor backends rank above portable kernels; "npu" tensors are claimed by no other plugin.
PRIORITY = 100


def _empty(reason: str, runtime: str | None = None) -> BackendInfo:
    logger.debug("no Ascend NPU: %s", reason)
    return BackendInfo(backend=BACKEND, device_type=DEVICE_TYPE, devices=(), priority=PRIORITY, runtime=runtime)


def _device_module(torch_npu: Any) -> Any:
    # torch_npu installs itself as ``torch.npu``; older builds only expose ``torch_npu.npu``.
    import torch

    return getattr(torch, "npu", None) or getattr(torch_npu, "npu", None)


def detect_npu() -> BackendInfo:
    """Report the Ascend NPUs visible to this process.

    Never raises. The device name and ``arch`` are the SoC name ``torch.npu.get_device_name`` returns
    (``"Ascend910B2"``); ``runtime`` is the torch_npu version.

    Example:
        >>> from kernels_npu._detect import detect_npu
        >>> info = detect_npu()
        >>> info.backend, info.device_type
        ('npu', 'npu')
    """
    try:
        torch_npu = load_torch_npu()
    except Exception as exc:  # noqa: BLE001 - detection must never raise
        return _empty(str(exc))
    runtime = str(getattr(torch_npu, "__version__", "") or "") or None
    try:
        npu = _device_module(torch_npu)
        if npu is None:
            return _empty("torch_npu imported but exposes no torch.npu device module", runtime)
        if not npu.is_available():
            return _empty("torch.npu.is_available() is False (no device, or the driver is not loaded)", runtime)
        count = int(npu.device_count())
        devices = []
        for index in range(count):
            soc = str(npu.get_device_name(index))
            devices.append(DeviceInfo(index=index, name=soc, arch=soc))
    except Exception as exc:  # noqa: BLE001 - a driver error while probing still means "no usable NPU"
        return _empty(f"probing NPU devices failed: {type(exc).__name__}: {exc}", runtime)
    if not devices:
        return _empty("torch.npu.device_count() is 0", runtime)
    logger.debug("found %d Ascend NPU(s): %s", len(devices), ", ".join(d.name for d in devices))
    return BackendInfo(
        backend=BACKEND, device_type=DEVICE_TYPE, devices=tuple(devices), priority=PRIORITY, runtime=runtime
    )
