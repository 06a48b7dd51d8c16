"""vmmshare: the Ascend ACL virtual-memory-management runtime and its cross-process memory sharing.

`acl` and the Pythonic objects are imported on first use, so that the command line loads only what it runs (and
can report a bad VMMSHARE_* variable itself instead of failing while it imports the broker client).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AclError,
    AclInvalidParamError,
    ContextNullError,
    FeatureNotSupportedError,
    InternalError,
    InvalidDeviceError,
    InvalidHandleError,
    InvalidMemoryTypeError,
    InvalidParamError,
    IpcError,
    MemoryAllocationError,
    NoPermissionError,
)

if TYPE_CHECKING:
    from . import acl
    from .api.buffers import DeviceBuffer, IpcMemory, ipc_open
    from .api.events import Event
    from .api.mapping import Mapping, VirtualRange
    from .api.memory import Device, PhysicalMemory, ShareableHandle, import_handle
    from .api.pool_buffers import PoolBuffer
    from .api.pools import MemoryPool

__version__ = "0.1.0"

_LAZY = {
    "acl": "",
    **dict.fromkeys(("Device", "PhysicalMemory", "ShareableHandle", "import_handle"), "api.memory"),
    **dict.fromkeys(("Mapping", "VirtualRange"), "api.mapping"),
    **dict.fromkeys(("DeviceBuffer", "IpcMemory", "ipc_open"), "api.buffers"),
    "Event": "api.events",
    "MemoryPool": "api.pools",
    "PoolBuffer": "api.pool_buffers",
}


def __getattr__(name: str) -> Any:
    """`vmmshare.acl`, `vmmshare.Device`, ...: imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if name == "acl" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AclError",
    "AclInvalidParamError",
    "ContextNullError",
    "Device",
    "DeviceBuffer",
    "Event",
    "FeatureNotSupportedError",
    "InternalError",
    "InvalidDeviceError",
    "InvalidHandleError",
    "InvalidMemoryTypeError",
    "InvalidParamError",
    "IpcError",
    "IpcMemory",
    "Mapping",
    "MemoryAllocationError",
    "MemoryPool",
    "NoPermissionError",
    "PhysicalMemory",
    "PoolBuffer",
    "ShareableHandle",
    "VirtualRange",
    "__version__",
    "acl",
    "import_handle",
    "ipc_open",
]
