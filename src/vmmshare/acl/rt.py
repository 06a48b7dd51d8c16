"""``acl.rt``: devices, streams, copies and the virtual-memory-management calls (SPEC §2)."""

from __future__ import annotations

from typing import Any

from .. import constants as C
from .._process import runtime
from ..errors import InvalidParamError
from ..handles import default_bytes
from ..props import check_int
from ._call import acl_call

# ---------------------------------------------------------------- devices and streams


@acl_call()
def set_device(device_id: int) -> None:
    runtime().set_device(device_id)


@acl_call()
def reset_device(device_id: int) -> None:
    runtime().reset_device(device_id)


@acl_call()
def reset_device_force(device_id: int) -> None:
    runtime().reset_device(device_id, force=True)


@acl_call(0)
def get_device_count() -> int:
    return runtime().devices


@acl_call(0)
def create_stream() -> int:
    return runtime().create_stream()


@acl_call()
def destroy_stream(stream: int) -> None:
    runtime().destroy_stream(stream)


@acl_call()
def destroy_stream_force(stream: int) -> None:
    runtime().destroy_stream(stream)


@acl_call()
def synchronize_stream(stream: int) -> None:
    runtime().synchronize_stream(stream)


@acl_call(0)
def device_can_access_peer(device_id: int, peer_device_id: int) -> int:
    return runtime().can_access_peer(device_id, peer_device_id)


@acl_call()
def device_enable_peer_access(peer_device_id: int, flags: int) -> None:
    runtime().enable_peer_access(peer_device_id, flags)


# ---------------------------------------------------------------- host memory and copies


@acl_call(0)
def malloc_host(size: int) -> int:
    return runtime().malloc_host(size)


@acl_call()
def free_host(ptr: int) -> None:
    runtime().free_host(ptr)


@acl_call()
def memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> None:
    runtime().memcpy(dst, dest_max, src, count, kind)


@acl_call()
def memset(dev_ptr: int, max_count: int, value: int, count: int) -> None:
    runtime().memset(dev_ptr, max_count, value, count)


@acl_call(0, 0)
def get_mem_info(attr: int) -> tuple[int, int]:
    return runtime().mem_info(attr)


# ---------------------------------------------------------------- physical memory, reservations, mappings


@acl_call(0)
def mem_get_allocation_granularity(prop: dict[str, Any], option: int) -> int:
    return runtime().granularity(prop, option)


@acl_call(0)
def malloc_physical(size: int, prop: dict[str, Any], flags: int) -> int:
    return runtime().malloc_physical(size, prop, flags)


@acl_call()
def free_physical(handle: int) -> None:
    runtime().free_physical(handle)


@acl_call(0)
def reserve_mem_address(size: int, alignment: int, expect_ptr: int | None, flags: int) -> int:
    return runtime().reserve(size, alignment, expect_ptr, flags)


@acl_call()
def release_mem_address(dev_ptr: int) -> None:
    runtime().release_reservation(dev_ptr)


@acl_call()
def map_mem(dev_ptr: int, size: int, offset: int, handle: int, flags: int) -> None:
    runtime().map(dev_ptr, size, offset, handle, flags, C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE)


@acl_call()
def mem_map_no_access(dev_ptr: int, size: int, offset: int, handle: int, flags: int) -> None:
    runtime().map(dev_ptr, size, offset, handle, flags, C.ACL_RT_MEM_ACCESS_FLAGS_NONE)


@acl_call()
def unmap_mem(dev_ptr: int) -> None:
    runtime().unmap(dev_ptr)


@acl_call()
def mem_set_access(dev_ptr: int, size: int, desc_list: list[dict[str, Any]]) -> None:
    runtime().set_access(dev_ptr, size, desc_list)


@acl_call(0)
def mem_get_access(dev_ptr: int, location: dict[str, int]) -> int:
    return runtime().get_access(dev_ptr, location)


@acl_call(0)
def mem_retain_allocation_handle(dev_ptr: int) -> int:
    return runtime().retain(dev_ptr)


@acl_call(None)
def mem_get_allocation_properties_from_handle(handle: int) -> dict[str, Any]:
    return runtime().properties(handle)


@acl_call(0, 0)
def mem_get_address_range(dev_ptr: int) -> tuple[int, int]:
    return runtime().address_range(dev_ptr)


# ---------------------------------------------------------------- sharing


def _default_handle(shareable: object) -> bytes:
    return default_bytes(check_int("shareableHandle", shareable, 0, (1 << 64) - 1))


def _shareable(shareable: object, share_type: object) -> tuple[bytes, int]:
    st = check_int("shareType", share_type, 0, 0xFFFFFFFF)
    if st == C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT:
        return _default_handle(shareable), st
    if st == C.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC:
        if not isinstance(shareable, (bytes, bytearray, memoryview)):
            raise InvalidParamError(f"a FABRIC shareable handle is 128 bytes, got {type(shareable).__name__}")
        return bytes(shareable), st
    raise InvalidParamError(f"shareType={st}: use ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT (1) or FABRIC (2)")


@acl_call(0)
def mem_export_to_shareable_handle(handle: int, handle_type: int, flags: int) -> int:
    ht = check_int("handleType", handle_type, 0, 0xFFFFFFFF)
    if ht not in (C.ACL_MEM_HANDLE_TYPE_NONE, C.ACL_MEM_HANDLE_TYPE_POSIX):
        raise InvalidParamError(f"handleType={ht}: use ACL_MEM_HANDLE_TYPE_NONE (0)")
    raw = runtime().export(handle, flags, C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT)
    return int.from_bytes(raw, "little")


@acl_call()
def mem_set_pid_to_shareable_handle(shareable_handle: int, pid_list: list[int]) -> None:
    runtime().set_pids(_default_handle(shareable_handle), C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, pid_list)


@acl_call(0)
def mem_import_from_shareable_handle(shareable_handle: int, device_id: int) -> int:
    rt = runtime()
    device = rt._device(device_id)
    return rt.import_handle(_default_handle(shareable_handle), C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, device)


@acl_call(0)
def mem_export_to_shareable_handle_v2(handle: int, flags: int, share_type: int) -> int | bytes:
    raw = runtime().export(handle, flags, share_type)
    return int.from_bytes(raw, "little") if share_type == C.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT else raw


@acl_call()
def mem_set_pid_to_shareable_handle_v2(shareable_handle: int | bytes, share_type: int, pid_list: list[int]) -> None:
    raw, st = _shareable(shareable_handle, share_type)
    runtime().set_pids(raw, st, pid_list)


@acl_call(0)
def mem_import_from_shareable_handle_v2(shareable_handle: int | bytes, share_type: int, flags: int) -> int:
    raw, st = _shareable(shareable_handle, share_type)
    check_int("flags", flags, 0, 0)
    rt = runtime()
    return rt.import_handle(raw, st, rt.current_device(), flags)


@acl_call(0)
def device_get_bare_tgid() -> int:
    return runtime().bare_tgid()
