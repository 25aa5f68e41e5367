"""kernels-core: pick the best kernel for every layer of a model, per instance and per device, reversibly."""

from ._hookspecs import hookimpl
from ._types import BackendInfo
from ._types import Binding
from ._types import CapabilityRange
from ._types import Decline
from ._types import DeviceInfo
from ._types import KernelSpec
from ._types import LayerKind
from ._types import Match
from ._types import Mode
from ._types import Supports


__all__ = [
    "BackendInfo",
    "Binding",
    "CapabilityRange",
    "Decline",
    "DeviceInfo",
    "KernelSpec",
    "LayerKind",
    "Match",
    "Mode",
    "Supports",
    "hookimpl",
]
