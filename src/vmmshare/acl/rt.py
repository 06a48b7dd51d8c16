"""``acl.rt``: devices, streams, copies and the virtual-memory-management calls (SPEC §2).

Each call parses its arguments into typed values here, once (the runtime takes only those), and passes them to
the runtime's part that holds the state.
"""

from __future__ import annotations

from typing import Any

from .. import constants as C
from .._process import runtime
from ..errors import InvalidHandleError, InvalidParamError
from ..handles import ShareableHandle, ShareType
from ..props import (
    U64,
    check_device,
    check_int,
    check_pids,
    check_ptr,
    parse_access_descs,
    parse_location,
    parse_prop,
)
from ._call import acl_call

# ---------------------------------------------------------------- devices and streams


@acl_call()
def set_device(device_id: int) -> None:
    runtime().devices.set(check_device(device_id))


@acl_call()
def reset_device(device_id: int) -> None:
    runtime().devices.reset(check_device(device_id))


@acl_call()
def reset_device_force(device_id: int) -> None:
    runtime().devices.reset(check_device(device_id), force=True)


@acl_call(0)
def get_device_count() -> int:
    return runtime().devices.count


@acl_call(0)
def create_stream() -> int:
    return runtime().devices.create_stream()


@acl_call()
def destroy_stream(stream: int) -> None:
    runtime().devices.destroy_stream(check_ptr("stream", stream))


@acl_call()
def destroy_stream_force(stream: int) -> None:
    runtime().devices.destroy_stream(check_ptr("stream", stream))


@acl_call()
def synchronize_stream(stream: int) -> None:
    runtime().devices.synchronize_stream(check_ptr("stream", stream))


@acl_call(0)
def device_can_access_peer(device_id: int, peer_device_id: int) -> int:
    return runtime().devices.can_access_peer(check_device(device_id), check_device(peer_device_id))


@acl_call()
def device_enable_peer_access(peer_device_id: int, flags: int) -> None:
    peer = check_device(peer_device_id)
    check_int("flags", flags, 0, 0)
    runtime().devices.enable_peer_access(peer)


# ---------------------------------------------------------------- host memory and copies


@acl_call(0)
def malloc_host(size: int) -> int:
    return runtime().copies.malloc_host(check_int("size", size))


@acl_call()
def free_host(ptr: int) -> None:
    runtime().copies.free_host(check_ptr("ptr", ptr))


@acl_call()
def memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> None:
    d, s = check_ptr("dst", dst), check_ptr("src", src)
    dmax, n = check_int("destMax", dest_max), check_int("count", count)
    k = check_int("kind", kind, C.ACL_MEMCPY_HOST_TO_HOST, C.ACL_MEMCPY_DEFAULT)
    runtime().copies.memcpy(d, dmax, s, n, k)


@acl_call()
def memset(dev_ptr: int, max_count: int, value: int, count: int) -> None:
    p = check_ptr("devPtr", dev_ptr)
    mx, n = check_int("maxCount", max_count), check_int("count", count)
    v = check_int("value", value, -(1 << 31), (1 << 31) - 1)
    runtime().copies.memset(p, mx, v, n)


@acl_call(0, 0)
def get_mem_info(attr: int) -> tuple[int, int]:
    check_int("attr", attr, 0, 17)
    rt = runtime()
    return rt.mem_info(rt.devices.current())


# ---------------------------------------------------------------- physical memory, reservations, mappings


@acl_call(0)
def mem_get_allocation_granularity(prop: dict[str, Any], option: int) -> int:
    check_int("option", option, C.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, C.ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return runtime().memory.granularity(parse_prop(prop))


@acl_call(0)
def malloc_physical(size: int, prop: dict[str, Any], flags: int) -> int:
    n = check_int("size", size, 0, U64)
    p = parse_prop(prop)
    check_int("flags", flags, 0, 0)
    return runtime().memory.malloc_physical(n, p)


@acl_call()
def free_physical(handle: int) -> None:
    runtime().memory.free_physical(check_int("handle", handle))


@acl_call(0)
def reserve_mem_address(size: int, alignment: int, expect_ptr: int | None, flags: int) -> int:
    n = check_int("size", size)
    a = check_int("alignment", alignment)
    want = check_ptr("expectPtr", expect_ptr)
    check_int("flags", flags, 0, 0)
    return runtime().memory.reserve(n, a, want)


@acl_call()
def release_mem_address(dev_ptr: int) -> None:
    runtime().memory.release(check_ptr("ptr", dev_ptr))


def _map(dev_ptr: object, size: object, offset: object, handle: object, flags: object, access: int) -> None:
    p, n = check_ptr("ptr", dev_ptr), check_int("size", size)
    o = check_int("offset", offset)
    check_int("flags", flags, 0, 0)
    runtime().memory.map(p, n, o, check_int("handle", handle), access)


@acl_call()
def map_mem(dev_ptr: int, size: int, offset: int, handle: int, flags: int) -> None:
    _map(dev_ptr, size, offset, handle, flags, C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE)


@acl_call()
def mem_map_no_access(dev_ptr: int, size: int, offset: int, handle: int, flags: int) -> None:
    _map(dev_ptr, size, offset, handle, flags, C.ACL_RT_MEM_ACCESS_FLAGS_NONE)


@acl_call()
def unmap_mem(dev_ptr: int) -> None:
    runtime().memory.unmap(check_ptr("ptr", dev_ptr))


@acl_call()
def mem_set_access(dev_ptr: int, size: int, desc_list: list[dict[str, Any]]) -> None:
    p, n = check_ptr("ptr", dev_ptr), check_int("size", size)
    runtime().memory.set_access(p, n, parse_access_descs(desc_list))


@acl_call(0)
def mem_get_access(dev_ptr: int, location: dict[str, int]) -> int:
    p = check_ptr("ptr", dev_ptr)
    return runtime().memory.get_access(p, parse_location(location, "location"))


@acl_call(0)
def mem_retain_allocation_handle(dev_ptr: int) -> int:
    return runtime().memory.retain(check_ptr("ptr", dev_ptr))


@acl_call(None)
def mem_get_allocation_properties_from_handle(handle: int) -> dict[str, Any]:
    return runtime().memory.properties(check_int("handle", handle))


@acl_call(0, 0)
def mem_get_address_range(dev_ptr: int) -> tuple[int, int]:
    return runtime().memory.address_range(check_ptr("ptr", dev_ptr))


# ---------------------------------------------------------------- sharing


def _default(shareable: object) -> ShareableHandle:
    value = check_int("shareableHandle", shareable, 0, U64)
    if value == 0:
        raise InvalidHandleError("shareable handle 0 is never valid")
    return ShareableHandle.default(value)


def _share_type(share_type: object) -> ShareType:
    st = check_int("shareType", share_type, 0, 0xFFFFFFFF)
    if st not in (C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC):
        raise InvalidParamError(f"shareType={st}: use ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT (1) or FABRIC (2)")
    return ShareType(st)


def _shareable(shareable: object, share_type: object) -> ShareableHandle:
    st = _share_type(share_type)
    if st is ShareType.DEFAULT:
        return _default(shareable)
    if not isinstance(shareable, (bytes, bytearray, memoryview)):
        raise InvalidParamError(f"a FABRIC shareable handle is 128 bytes, got {type(shareable).__name__}")
    return ShareableHandle.of(st, bytes(shareable))


def _export_flags(flags: object) -> bool:
    """Export flags -> whether the trustlist is checked (rule 10: 0 or DISABLE_PID_VALIDATION)."""
    f = check_int("flags", flags, 0, U64)
    if f not in (C.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, C.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION):
        raise InvalidParamError(f"flags={f}: use ACL_RT_VMM_EXPORT_FLAG_DEFAULT (0) or DISABLE_PID_VALIDATION (1)")
    return f == C.ACL_RT_VMM_EXPORT_FLAG_DEFAULT


@acl_call(0)
def mem_export_to_shareable_handle(handle: int, handle_type: int, flags: int) -> int:
    ht = check_int("handleType", handle_type, 0, 0xFFFFFFFF)
    if ht not in (C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_HANDLE_TYPE_POSIX):
        raise InvalidParamError(f"handleType={ht}: use ACL_MEM_HANDLE_TYPE_NONE (0)")
    h = check_int("handle", handle)
    validate = _export_flags(flags)
    return runtime().sharing.export(h, ShareType.DEFAULT, validate).value


@acl_call()
def mem_set_pid_to_shareable_handle(shareable_handle: int, pid_list: list[int]) -> None:
    shareable = _default(shareable_handle)
    runtime().sharing.set_pids(shareable, check_pids(pid_list))


@acl_call(0)
def mem_import_from_shareable_handle(shareable_handle: int, device_id: int) -> int:
    rt = runtime()
    device = rt.device_id(check_device(device_id))
    return rt.sharing.import_handle(_default(shareable_handle), device)


@acl_call(0)
def mem_export_to_shareable_handle_v2(handle: int, flags: int, share_type: int) -> int | bytes:
    h = check_int("handle", handle)
    validate = _export_flags(flags)
    exported = runtime().sharing.export(h, _share_type(share_type), validate)
    return exported.value if exported.share_type is ShareType.DEFAULT else exported.raw


@acl_call()
def mem_set_pid_to_shareable_handle_v2(shareable_handle: int | bytes, share_type: int, pid_list: list[int]) -> None:
    shareable = _shareable(shareable_handle, share_type)
    runtime().sharing.set_pids(shareable, check_pids(pid_list))


@acl_call(0)
def mem_import_from_shareable_handle_v2(shareable_handle: int | bytes, share_type: int, flags: int) -> int:
    shareable = _shareable(shareable_handle, share_type)
    check_int("flags", flags, 0, 0)
    rt = runtime()
    return rt.sharing.import_handle(shareable, rt.devices.current())


@acl_call(0)
def device_get_bare_tgid() -> int:
    return runtime().sharing.bare_tgid()
