"""Emulated ``torch.npu`` device module: a configurable list of simulated Ascend SoCs, no real device.

Only what detection reads is emulated: ``is_available``, ``device_count``, ``get_device_name``,
``current_device``. Tensors never live on an emulated NPU; the kernels run on CPU tensors.
"""

from __future__ import annotations

import os


__all__ = ["current_device", "device_count", "get_device_name", "is_available", "set_emulated_devices"]

# TORCH_NPU_EMULATION_DEVICES="Ascend910B2,Ascend910B2" simulates two NPUs; an empty value simulates none.
_devices: list[str] = [
    name for name in os.environ.get("TORCH_NPU_EMULATION_DEVICES", "Ascend910B2").split(",") if name
]


def set_emulated_devices(names: list[str]) -> None:
    """Replace the simulated devices (SoC names, one per device); ``[]`` simulates a host with no NPU."""
    _devices[:] = list(names)


def is_available() -> bool:
    return bool(_devices)


def device_count() -> int:
    return len(_devices)


def current_device() -> int:
    if not _devices:
        raise RuntimeError("emulated torch.npu: no NPU device")
    return 0


def get_device_name(device_name: object = None) -> str:
    index = 0 if device_name is None else getattr(device_name, "index", device_name)
    index = 0 if index is None else int(index)
    if not 0 <= index < len(_devices):
        raise RuntimeError(f"emulated torch.npu: invalid device index {index} ({len(_devices)} device(s))")
    return _devices[index]
