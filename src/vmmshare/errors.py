"""The ACL error model: `AclError` exceptions keyed by code and the per-thread recent error message."""

from __future__ import annotations

import threading

from . import constants as C

_recent = threading.local()


class AclError(Exception):
    """A failed runtime call: `.code` is the ACL error code, `.message` says what was wrong and what to do."""

    code: int = C.ACL_ERROR_RT_INTERNAL_ERROR

    def __init__(self, message: str, code: int | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{C.error_name(self.code)} ({self.code}): {message}")

    def __reduce__(self) -> tuple[object, ...]:
        return (error_from_code, (self.code, self.message))


class InvalidParamError(AclError, ValueError):
    code = C.ACL_ERROR_RT_PARAM_INVALID


class AclInvalidParamError(InvalidParamError):
    """ACL_ERROR_INVALID_PARAM (100000): an argument the acl layer itself refuses (SPEC §4a), before the runtime
    sees it; an `InvalidParamError`, so code catching the runtime's 107000 catches it too."""

    code = C.ACL_ERROR_INVALID_PARAM


class InvalidMemoryTypeError(AclError, ValueError):
    """ACL_ERROR_RT_INVALID_MEMORY_TYPE (107016): a memory attribute outside aclrtMemAttr."""

    code = C.ACL_ERROR_RT_INVALID_MEMORY_TYPE


class InvalidDeviceError(AclError, ValueError):
    code = C.ACL_ERROR_RT_INVALID_DEVICEID


class ContextNullError(AclError):
    code = C.ACL_ERROR_RT_CONTEXT_NULL


class StreamContextError(AclError):
    """A stream used while another context than its own is current (the runtime's RT_ERROR_STREAM_CONTEXT)."""

    code = C.ACL_ERROR_RT_STREAM_CONTEXT


class InvalidHandleError(AclError, KeyError):
    code = C.ACL_ERROR_RT_INVALID_HANDLE

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class FeatureNotSupportedError(AclError):
    code = C.ACL_ERROR_RT_FEATURE_NOT_SUPPORT


class MemoryAllocationError(AclError, MemoryError):
    code = C.ACL_ERROR_RT_MEMORY_ALLOCATION


class NoPermissionError(AclError, PermissionError):
    code = C.ACL_ERROR_RT_NO_PERMISSION


class InternalError(AclError):
    code = C.ACL_ERROR_RT_INTERNAL_ERROR


class IpcError(AclError, ConnectionError):
    code = C.ACL_ERROR_RT_IPC_ERROR


_BY_CODE: dict[int, type[AclError]] = {
    cls.code: cls
    for cls in (
        AclInvalidParamError,
        InvalidParamError,
        InvalidMemoryTypeError,
        InvalidDeviceError,
        ContextNullError,
        StreamContextError,
        InvalidHandleError,
        FeatureNotSupportedError,
        MemoryAllocationError,
        NoPermissionError,
        InternalError,
        IpcError,
    )
}


def error_from_code(code: int, message: str) -> AclError:
    """The `AclError` subclass for `code` (plain `AclError` for codes without one)."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else AclError(message, code)


def set_recent_error(message: str, code: int | None = None) -> None:
    """Record the message that `acl.get_recent_err_msg()` returns in this thread (and, with `code`, the code that
    `acl.rt.peek_at_last_error` / `get_last_error` report)."""
    _recent.message = message
    if code is not None:
        _recent.code = code


def last_error(clear: bool) -> int:
    """The code of the last failed call in this thread (0 if none, or none since it was cleared)."""
    code: int = getattr(_recent, "code", 0)
    if clear:
        _recent.code = 0
    return code


def recent_error() -> str:
    """The last failure's message in this thread ("" when nothing failed yet)."""
    return getattr(_recent, "message", "")
