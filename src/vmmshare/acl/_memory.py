"""``acl.rt`` physical memory, reservations and mappings (SPEC §2), with the acl layer's own checks (SPEC §4a).

Each call converts its arguments first (a wrong type is 107000, as pyACL refuses it), then makes the acl layer's
checks in the runtime's order (100000), then hands typed values to the runtime, whose checks keep their codes.
"""

from __future__ import annotations

from typing import Any

from .. import constants as C
from .._process import runtime
from ..errors import AclInvalidParamError, InvalidMemoryTypeError, InvalidParamError
from ..wire.props import (
    U32,
    acl_require,
    check_int,
    check_location,
    check_prop,
    check_ptr,
    parse_access_descs,
    read_location,
    read_prop,
)
from ._args import I32
from ._call import acl_call

__all__ = [
    "free_physical", "get_mem_info", "malloc_physical", "map_mem", "mem_get_access", "mem_get_address_range",
    "mem_get_allocation_granularity", "mem_get_allocation_properties_from_handle", "mem_map_no_access",
    "mem_retain_allocation_handle", "mem_set_access", "release_mem_address", "reserve_mem_address", "unmap_mem",
]


@acl_call(0, 0)
def get_mem_info(attr: int) -> tuple[int, int]:
    a = check_int("attr", attr, *I32)
    if not 0 <= a < len(C.MEM_ATTR_NAMES):
        raise InvalidMemoryTypeError(f"attr={a} is not an aclrtMemAttr (0 ACL_DDR_MEM .. 17 ACL_MEM_P2P_HUGE1G)")
    rt = runtime()
    return rt.mem_info(rt.devices.current())


@acl_call(0)
def mem_get_allocation_granularity(prop: dict[str, Any], option: int) -> int:
    opt = check_int("option", option, 0, U32)
    p = read_prop(prop)
    acl_require(p is not None, "prop is NULL: pass an aclrtPhysicalMemProp dict")
    assert p is not None
    check_prop(p, for_malloc=False)
    if opt not in (C.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, C.ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED):
        raise InvalidParamError(f"option={opt}: use ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM (0) or RECOMMENDED (1)")
    return runtime().memory.granularity(p)


@acl_call(0)
def malloc_physical(size: int, prop: dict[str, Any], flags: int) -> int:
    n, f = check_int("size", size), check_int("flags", flags)
    p = read_prop(prop)
    acl_require(p is not None, "prop is NULL: pass an aclrtPhysicalMemProp dict")
    assert p is not None
    acl_require(n != 0, "size is 0: allocate a positive multiple of the granularity")
    acl_require(f == 0, f"flags={f}: reserved, must be 0")
    check_prop(p, for_malloc=True)
    rt = runtime()
    if p.location.type == C.ACL_MEM_LOCATION_TYPE_HOST_NUMA:
        rt.devices.current()  # the runtime places NUMA memory for the current context's device
    return rt.memory.malloc_physical(n, p)


@acl_call()
def free_physical(handle: int) -> None:
    h = check_ptr("handle", handle)
    if h == 0:
        raise AclInvalidParamError("handle is NULL")
    runtime().memory.free_physical(h)


@acl_call(0)
def reserve_mem_address(size: int, alignment: int, expect_ptr: int | None, flags: int) -> int:
    n, a = check_int("size", size), check_int("alignment", alignment)
    want, f = check_ptr("expectPtr", expect_ptr), check_int("flags", flags)
    acl_require(n != 0, "size is 0: reserve a positive multiple of the granularity")
    acl_require(f in (0, 1), f"flags={f}: must be 0 (1 is accepted for compatibility and means 0)")
    return runtime().memory.reserve(n, a, want)


@acl_call()
def release_mem_address(dev_ptr: int) -> None:
    p = check_ptr("ptr", dev_ptr)
    acl_require(p != 0, "ptr is NULL")
    runtime().memory.release(p)


def _map(dev_ptr: object, size: object, offset: object, handle: object, flags: object, access: int) -> None:
    p, n = check_ptr("ptr", dev_ptr), check_int("size", size)
    o, h, f = check_int("offset", offset), check_ptr("handle", handle), check_int("flags", flags)
    acl_require(p != 0, "ptr is NULL")
    acl_require(h != 0, "handle is NULL")
    acl_require(n != 0, "size is 0: map the allocation's whole size")
    acl_require(f == 0, f"flags={f}: reserved, must be 0")
    runtime().memory.map(p, n, o, h, access)


@acl_call()
def map_mem(dev_ptr: int, size: int, offset: int, handle: int, flags: int) -> None:
    _map(dev_ptr, size, offset, handle, flags, C.ACL_RT_MEM_ACCESS_FLAGS_READWRITE)


@acl_call()
def mem_map_no_access(dev_ptr: int, size: int, offset: int, handle: int, flags: int) -> None:
    _map(dev_ptr, size, offset, handle, flags, C.ACL_RT_MEM_ACCESS_FLAGS_NONE)


@acl_call()
def unmap_mem(dev_ptr: int) -> None:
    p = check_ptr("ptr", dev_ptr)
    acl_require(p != 0, "ptr is NULL")
    runtime().memory.unmap(p)


@acl_call()
def mem_set_access(dev_ptr: int, size: int, desc_list: list[dict[str, Any]]) -> None:
    p, n = check_ptr("ptr", dev_ptr), check_int("size", size)
    runtime().memory.set_access(p, n, parse_access_descs(desc_list))


@acl_call(0)
def mem_get_access(dev_ptr: int, location: dict[str, int]) -> int:
    p = check_ptr("ptr", dev_ptr)
    loc = None if location is None else read_location(location, "location")
    acl_require(p != 0, "ptr is NULL")
    acl_require(loc is not None, "location is NULL: pass an aclrtMemLocation dict")
    assert loc is not None
    return runtime().memory.get_access(p, check_location(loc, "location"))


@acl_call(0)
def mem_retain_allocation_handle(dev_ptr: int) -> int:
    p = check_ptr("ptr", dev_ptr)
    acl_require(p != 0, "ptr is NULL")
    return runtime().memory.retain(p)


@acl_call(None)
def mem_get_allocation_properties_from_handle(handle: int) -> dict[str, Any]:
    h = check_ptr("handle", handle)
    acl_require(h != 0, "handle is NULL")
    return runtime().memory.properties(h)


@acl_call(0, 0)
def mem_get_address_range(dev_ptr: int) -> tuple[int, int]:
    p = check_ptr("ptr", dev_ptr)
    acl_require(p != 0, "ptr is NULL")
    return runtime().memory.address_range(p)
