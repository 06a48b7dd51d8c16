"""vmmshare: the Ascend ACL virtual-memory-management runtime and its cross-process memory sharing."""

from __future__ import annotations

from . import acl
from .errors import (
    AclError,
    ContextNullError,
    FeatureNotSupportedError,
    InternalError,
    InvalidDeviceError,
    InvalidHandleError,
    InvalidParamError,
    IpcError,
    MemoryAllocationError,
    NoPermissionError,
)
from .memory import Device, Mapping, PhysicalMemory, ShareableHandle, VirtualRange, import_handle

__version__ = "0.1.0"

__all__ = [
    "AclError",
    "ContextNullError",
    "Device",
    "FeatureNotSupportedError",
    "InternalError",
    "InvalidDeviceError",
    "InvalidHandleError",
    "InvalidParamError",
    "IpcError",
    "Mapping",
    "MemoryAllocationError",
    "NoPermissionError",
    "PhysicalMemory",
    "ShareableHandle",
    "VirtualRange",
    "__version__",
    "acl",
    "import_handle",
]
