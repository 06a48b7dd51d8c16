"""vmmshare: the Ascend ACL virtual-memory-management runtime and its cross-process memory sharing."""

from __future__ import annotations

from . import acl
from .buffers import DeviceBuffer, IpcMemory, ipc_open
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
from .memory import Device, Mapping, PhysicalMemory, ShareableHandle, VirtualRange, import_handle

__version__ = "0.1.0"

__all__ = [
    "AclError",
    "AclInvalidParamError",
    "ContextNullError",
    "Device",
    "DeviceBuffer",
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
    "NoPermissionError",
    "PhysicalMemory",
    "ShareableHandle",
    "VirtualRange",
    "__version__",
    "acl",
    "import_handle",
    "ipc_open",
]
