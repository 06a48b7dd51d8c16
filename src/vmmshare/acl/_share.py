"""``acl.rt`` sharing of physical memory by shareable handle (SPEC §2, rules 9-17; the acl layer's checks, §4a)."""

from __future__ import annotations

import functools

from .. import constants as C
from .._process import runtime
from ..errors import AclInvalidParamError, InvalidHandleError, InvalidParamError
from ..wire.handles import ShareableHandle, ShareType
from ..wire.props import U32, U64, acl_require, check_int, check_pids, check_ptr
from ._args import read_pids
from ._call import acl_call

__all__ = [
    "device_get_bare_tgid", "mem_export_to_shareable_handle", "mem_export_to_shareable_handle_v2",
    "mem_import_from_shareable_handle", "mem_import_from_shareable_handle_v2", "mem_set_pid_to_shareable_handle",
    "mem_set_pid_to_shareable_handle_v2",
]


@functools.lru_cache(maxsize=256)
def _default(value: int) -> ShareableHandle:
    """The DEFAULT handle of `value` (a plain int: check_int's), made once: a handle is a value, and a program
    imports the same few again and again."""
    if value == 0:
        raise InvalidHandleError("shareable handle 0 is never valid")
    return ShareableHandle.default(value)


_SHARE_TYPES = {C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT: ShareType.DEFAULT,
                C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC: ShareType.FABRIC}


def _share_type(st: int) -> ShareType:
    kind = _SHARE_TYPES.get(st)
    if kind is None:
        raise InvalidParamError(f"shareType={st}: use ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT (1) or FABRIC (2)")
    return kind


def _read_shareable(shareable: object) -> int | bytes | None:
    """A V2 shareable handle argument: an int (DEFAULT), bytes-like (FABRIC) or None (NULL)."""
    if type(shareable) is int and 0 <= shareable <= U64:  # the common case, as check_int has it
        return shareable
    if shareable is None:
        return None
    if isinstance(shareable, (bytes, bytearray, memoryview)):
        return bytes(shareable)
    return check_int("shareableHandle", shareable, 0, U64)


def _shareable(raw: int | bytes, st: int) -> ShareableHandle:
    """The handle `raw` of share type `st`: 107000 for a type that is not DEFAULT or FABRIC (first), or a value
    that is not of its type."""
    if st == C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT:
        if not isinstance(raw, int):
            raise InvalidParamError(f"a DEFAULT shareable handle is an int, got {type(raw).__name__}")
        return _default(raw)
    share = _share_type(st)
    if not isinstance(raw, bytes):
        raise InvalidParamError(f"a FABRIC shareable handle is 128 bytes, got {type(raw).__name__}")
    return ShareableHandle.of(share, raw)


def _export_flags(flags: int) -> bool:
    """Export flags -> whether the trustlist is checked (rule 10: 0 or DISABLE_PID_VALIDATION)."""
    if flags not in (C.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION):
        raise InvalidParamError(f"flags={flags}: use ACL_RT_VMM_EXPORT_FLAG_DEFAULT (0) or DISABLE_PID_VALIDATION (1)")
    return flags == C.ACL_RT_VMM_EXPORT_FLAG_DEFAULT


@acl_call(0)
def mem_export_to_shareable_handle(handle: int, handle_type: int, flags: int) -> int:
    h, ht = check_ptr("handle", handle), check_int("handleType", handle_type, 0, U32)
    f = check_int("flags", flags)
    acl_require(h != 0, "handle is NULL")
    acl_require(ht == C.ACL_MEM_HANDLE_TYPE_NONE, f"handleType={ht}: use ACL_MEM_HANDLE_TYPE_NONE (0)")
    return runtime().sharing.export(h, ShareType.DEFAULT, _export_flags(f)).value


@acl_call()
def mem_set_pid_to_shareable_handle(shareable_handle: int, pid_list: list[int]) -> None:
    value = check_int("shareableHandle", shareable_handle)
    pids = read_pids("pid_list", pid_list)
    acl_require(pids is not None, "pid_list is NULL")
    acl_require(bool(pids), "pid_list is empty")
    assert pids is not None
    runtime().sharing.set_pids(_default(value), check_pids(pids))


@acl_call(0)
def mem_import_from_shareable_handle(shareable_handle: int, device_id: int) -> int:
    value = check_int("shareableHandle", shareable_handle)
    device = check_int("deviceId", device_id, -(1 << 31), (1 << 31) - 1)
    rt = runtime()
    return rt.sharing.import_handle(_default(value), rt.device_id(device)).handle


@acl_call(0)
def mem_export_to_shareable_handle_v2(handle: int, flags: int, share_type: int) -> int | bytes:
    h, f = check_ptr("handle", handle), check_int("flags", flags)
    st = check_int("shareType", share_type, 0, U32)
    acl_require(h != 0, "handle is NULL")
    share = _share_type(st)
    exported = runtime().sharing.export(h, share, _export_flags(f))
    return exported.value if exported.share_type is ShareType.DEFAULT else exported.raw


@acl_call()
def mem_set_pid_to_shareable_handle_v2(shareable_handle: int | bytes, share_type: int, pid_list: list[int]) -> None:
    raw = _read_shareable(shareable_handle)
    st = check_int("shareType", share_type, 0, U32)
    pids = read_pids("pid_list", pid_list)
    acl_require(raw is not None, "shareableHandle is NULL")
    acl_require(pids is not None, "pid_list is NULL")
    acl_require(bool(pids), "pid_list is empty")
    assert raw is not None and pids is not None
    runtime().sharing.set_pids(_shareable(raw, st), check_pids(pids))


@acl_call(0)
def mem_import_from_shareable_handle_v2(shareable_handle: int | bytes, share_type: int, flags: int) -> int:
    raw = _read_shareable(shareable_handle)
    st, f = check_int("shareType", share_type, 0, U32), check_int("flags", flags)
    if raw is None:
        raise AclInvalidParamError("shareableHandle is NULL")
    if f != 0:
        raise AclInvalidParamError(f"flags={f}: reserved, must be 0")
    rt = runtime()
    device = rt.devices.current()  # (a context's device is one this process has)
    return rt.sharing.import_handle(_shareable(raw, st), device).handle


@acl_call(0)
def device_get_bare_tgid() -> int:
    return runtime().sharing.bare_tgid()
