"""vmmshare: the Ascend ACL virtual-memory-management runtime and its cross-process memory sharing."""

from __future__ import annotations

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

__version__ = "0.1.0"

__all__ = [
    "AclError",
    "ContextNullError",
    "FeatureNotSupportedError",
    "InternalError",
    "InvalidDeviceError",
    "InvalidHandleError",
    "InvalidParamError",
    "IpcError",
    "MemoryAllocationError",
    "NoPermissionError",
    "__version__",
]
