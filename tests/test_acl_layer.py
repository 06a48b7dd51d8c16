"""SPEC §4a: the checks the acl layer makes itself return 100000, in the runtime's order (the first failing check
decides, before anything the runtime checks below, which keeps 107000 and the rest); the physical memory attribute
table; the codes the runtime adds (107016). Rows follow the runtime's acl layer (aclrt_impl/memory.cpp) and the
cases its unit tests check."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import vmmshare.acl as _acl
from conftest import (
    ACL_PARAM,
    BAD_DEVICE,
    BAD_HANDLE,
    BAD_MEMORY_TYPE,
    DEVICE,
    G2M,
    HOST,
    NO_CONTEXT,
    NOT_SUPPORTED,
    PARAM,
    GiB,
    expect_fail,
    loc,
    ok,
    prop,
    surface_acl,
)
from vmmshare._process import runtime
from vmmshare.constants import DDR_MEM_ATTRS, HUGE1G_ATTRS, HUGE_ATTRS, PHYSICAL_MEM_ATTRS

HOST_NUMA = 4
UNREGISTERED, MANAGED = 2, 3

@pytest.fixture(params=["python", "c"])
def acl(request):
    """Each test runs on both surfaces: vmmshare.acl, and the C library (libascendcl.so) through `cacl`."""
    yield from surface_acl(request.param)



def _prop(**fields: Any) -> dict[str, Any]:
    p = prop()
    location = fields.pop("location", None)
    p.update(fields)
    if location is not None:
        p["location"] = location
    return p


def _fails(code: int, words: str, fn: Any, *args: Any) -> None:
    msg = expect_fail(code, fn, *args)
    assert words in msg, f"{fn.__name__}{args!r}: expected the check of {words!r} to decide, got {msg!r}"


# ---------------------------------------------------------------- malloc_physical and the granularity


def test_malloc_physical_checks_in_the_acl_layers_order(acl):
    """prop NULL; size 0; flags; handleType; allocationType; UNREGISTERED/MANAGED; DDR on a device; the attribute.
    Each case also fails every later check: the first one decides."""
    rt = acl.rt
    worst = _prop(handleType=2, allocationType=1, memAttr=0, location=loc(0, UNREGISTERED))
    _fails(ACL_PARAM, "prop is NULL", rt.malloc_physical, 0, None, 1)
    _fails(ACL_PARAM, "size is 0", rt.malloc_physical, 0, worst, 1)
    _fails(ACL_PARAM, "flags=1", rt.malloc_physical, G2M, worst, 1)
    _fails(ACL_PARAM, "handleType=2", rt.malloc_physical, G2M, worst, 0)  # POSIX is not NONE either
    _fails(ACL_PARAM, "handleType=100", rt.malloc_physical, G2M, {**worst, "handleType": 100}, 0)
    worst.update(handleType=0)
    _fails(ACL_PARAM, "allocationType=1", rt.malloc_physical, G2M, worst, 0)
    worst.update(allocationType=0)
    _fails(ACL_PARAM, "location.type=2", rt.malloc_physical, G2M, worst, 0)
    _fails(ACL_PARAM, "location.type=3", rt.malloc_physical, G2M, {**worst, "location": loc(0, MANAGED)}, 0)
    for ddr in sorted(DDR_MEM_ATTRS):
        _fails(ACL_PARAM, f"memAttr={ddr} (ACL_DDR", rt.malloc_physical, G2M, prop(ddr), 0)
    for attr in (0, 1, 8, 9, 11, 18, 0xFFFFFFFF):
        _fails(ACL_PARAM, f"memAttr={attr} is not", rt.malloc_physical, G2M, prop(attr), 0)
    # the acl layer's check comes before the runtime's: a bad size and a bad attribute is the attribute's 100000
    _fails(ACL_PARAM, "memAttr=0", rt.malloc_physical, G2M + 1, prop(0), 0)


def test_malloc_physical_below_the_acl_layer_keeps_its_codes(acl):
    rt = acl.rt
    expect_fail(PARAM, rt.malloc_physical, G2M + 1, prop(), 0)  # not a multiple of the granularity
    expect_fail(PARAM, rt.malloc_physical, G2M, _prop(reserve=1), 0)  # reserved: the driver's check
    expect_fail(PARAM, rt.malloc_physical, G2M, prop(loc_type=9), 0)  # no aclrtMemLocationType
    expect_fail(BAD_DEVICE, rt.malloc_physical, G2M, prop(dev=99), 0)
    expect_fail(NOT_SUPPORTED, rt.malloc_physical, G2M, prop(dev=1, loc_type=HOST), 0)  # a HOST location's id is 0
    for attr in sorted(HUGE1G_ATTRS & PHYSICAL_MEM_ATTRS):  # 1 GiB pages are device memory only (the driver)
        expect_fail(NOT_SUPPORTED, rt.malloc_physical, GiB, prop(attr, loc_type=HOST), 0)
        expect_fail(NOT_SUPPORTED, rt.malloc_physical, GiB, prop(attr, loc_type=HOST_NUMA), 0)
    expect_fail(PARAM, rt.malloc_physical, "1", None, 0)  # a wrong type is pyACL's refusal, before any check


def test_granularity_checks_in_the_acl_layers_order(acl):
    """prop NULL; DDR on a device; the attribute; `option` is not the acl layer's (107000 below it)."""
    g = acl.rt.mem_get_allocation_granularity
    _fails(ACL_PARAM, "prop is NULL", g, None, 7)
    _fails(ACL_PARAM, "memAttr=3 (ACL_DDR", g, prop(3), 7)
    _fails(ACL_PARAM, "memAttr=9 is not", g, prop(9), 7)
    _fails(PARAM, "option=7", g, prop(), 7)
    expect_fail(PARAM, g, prop(handle_type=3), 0)  # the types are checked below for the granularity
    expect_fail(NOT_SUPPORTED, g, prop(loc_type=MANAGED), 0)
    expect_fail(NOT_SUPPORTED, g, prop(14, loc_type=HOST), 0)
    assert ok(g(prop(4, loc_type=HOST), 0)) == G2M  # the runtime's unit test: HBM_MEM_HUGE on the host
    assert ok(g(prop(10), 0)) == GiB


# ---------------------------------------------------------------- the attribute table

# attribute asked -> attribute reported by mem_get_allocation_properties_from_handle (the runtime's table)
DEVICE_REPORTED = {4: 4, 5: 5, 10: 10, 12: 5, 13: 4, 14: 10, 15: 15, 16: 16, 17: 17}
HOST_REPORTED = {2: 13, 3: 12, 4: 4, 5: 5, 6: 16, 7: 7, 12: 12, 13: 13, 15: 7, 16: 16}


def _expected(attr: int, loc_type: int) -> int | None:
    """The code malloc_physical gives for `attr` at `loc_type`, or None when it succeeds."""
    if attr not in PHYSICAL_MEM_ATTRS or (loc_type == DEVICE and attr in DDR_MEM_ATTRS):
        return ACL_PARAM
    if loc_type != DEVICE and attr in HUGE1G_ATTRS:
        return NOT_SUPPORTED
    return None


@pytest.mark.parametrize("loc_type", [HOST, DEVICE, HOST_NUMA], ids=["host", "device", "host-numa"])
@pytest.mark.parametrize("attr", range(18))
def test_attribute_table(vmm, attr, loc_type):
    """Every aclrtMemAttr at every location: refused by the acl layer, refused by the driver, or allocated with
    the attribute's granularity and pages, and reported back as the runtime reports it."""
    size = GiB if attr in HUGE1G_ATTRS else G2M
    code = _expected(attr, loc_type)
    p = prop(attr, loc_type=loc_type)
    if code is not None:
        expect_fail(code, vmm.rt.malloc_physical, size, p, 0)
        expect_fail(code, vmm.rt.mem_get_allocation_granularity, p, 0)
        return
    assert ok(vmm.rt.mem_get_allocation_granularity(p, 1)) == size
    h = vmm.alloc(size, attr=attr, loc_type=loc_type)
    if vmm.rt is _acl.rt:  # (the pages asked for are the Python runtime's record; the C library's are its own)
        alloc = runtime().memory.allocation(h)
        assert alloc.prop.huge_page == (GiB if attr in HUGE1G_ATTRS else G2M if attr in HUGE_ATTRS else 0)
    got = ok(vmm.rt.mem_get_allocation_properties_from_handle(h))
    table = DEVICE_REPORTED if loc_type == DEVICE else HOST_REPORTED
    assert got == {**p, "memAttr": table[attr]}


def test_every_accepted_attribute_is_in_the_reported_table():
    assert set(DEVICE_REPORTED) == PHYSICAL_MEM_ATTRS - DDR_MEM_ATTRS
    assert set(HOST_REPORTED) == PHYSICAL_MEM_ATTRS - HUGE1G_ATTRS


# ---------------------------------------------------------------- reservations and mappings


def test_reserve_checks(vmm):
    rt = vmm.rt
    _fails(ACL_PARAM, "size is 0", rt.reserve_mem_address, 0, 1, 4096, 2)
    _fails(ACL_PARAM, "flags=2", rt.reserve_mem_address, G2M, 1, 4096, 2)
    _fails(PARAM, "alignment=1", rt.reserve_mem_address, G2M, 1, 4096, 1)  # flags 1 is accepted
    expect_fail(PARAM, rt.reserve_mem_address, 1, 0, 0, 0)  # SPEC rule 3: a granularity-aligned size
    p = vmm.reserve()
    for call in (rt.release_mem_address, rt.unmap_mem):
        for null in (0, None):
            _fails(ACL_PARAM, "ptr is NULL", call, null)
    expect_fail(PARAM, rt.unmap_mem, p)  # reserved, not mapped: below the acl layer


@pytest.mark.parametrize("name", ["map_mem", "mem_map_no_access"])
def test_map_checks_in_the_acl_layers_order(vmm, name):
    """ptr NULL; handle NULL; size 0; flags. The offset is not the acl layer's: 107000 below it."""
    fn = getattr(vmm.rt, name)
    h, p = vmm.alloc(), vmm.reserve()
    _fails(ACL_PARAM, "ptr is NULL", fn, 0, 0, 5, 0, 1)
    _fails(ACL_PARAM, "handle is NULL", fn, p, 0, 5, None, 1)
    _fails(ACL_PARAM, "size is 0", fn, p, 0, 5, h, 1)
    _fails(ACL_PARAM, "flags=1", fn, p, G2M, 5, h, 1)
    _fails(PARAM, "offset=5", fn, p, G2M, 5, h, 0)
    vmm.map(p, G2M, h, no_access=name == "mem_map_no_access")


def test_access_checks(vmm):
    """mem_get_access: ptr NULL, location NULL (100000); mem_set_access has no acl-layer checks (107000)."""
    p, _ = vmm.mapped()
    rt = vmm.rt
    _fails(ACL_PARAM, "ptr is NULL", rt.mem_get_access, 0, None)
    _fails(ACL_PARAM, "location is NULL", rt.mem_get_access, p, None)
    expect_fail(PARAM, rt.mem_get_access, p, loc(0, 9))
    expect_fail(PARAM, rt.mem_set_access, 0, G2M, None)
    expect_fail(PARAM, rt.mem_set_access, p, G2M, None)
    for call in (rt.mem_retain_allocation_handle, rt.mem_get_address_range):
        _fails(ACL_PARAM, "ptr is NULL", call, 0)
    for call in (rt.free_physical, rt.mem_get_allocation_properties_from_handle):
        _fails(ACL_PARAM, "handle is NULL", call, 0)
        _fails(ACL_PARAM, "handle is NULL", call, None)


# ---------------------------------------------------------------- sharing


def test_export_checks(vmm):
    """V1: handle NULL, handleType not NONE (100000), then flags (107000); V2: handle NULL, then share type and
    flags below the acl layer (107000)."""
    rt = vmm.rt
    h = vmm.alloc()
    _fails(ACL_PARAM, "handle is NULL", rt.mem_export_to_shareable_handle, 0, 5, 7)
    _fails(ACL_PARAM, "handleType=5", rt.mem_export_to_shareable_handle, h, 5, 7)
    _fails(ACL_PARAM, "handleType=4294967295", rt.mem_export_to_shareable_handle, h, 0xFFFFFFFF, 7)
    _fails(PARAM, "flags=7", rt.mem_export_to_shareable_handle, h, 0, 7)
    _fails(ACL_PARAM, "handle is NULL", rt.mem_export_to_shareable_handle_v2, 0, 30, 9)
    _fails(PARAM, "shareType=9", rt.mem_export_to_shareable_handle_v2, h, 30, 9)
    _fails(PARAM, "flags=30", rt.mem_export_to_shareable_handle_v2, h, 30, 2)
    ok(rt.mem_export_to_shareable_handle_v2(h, 0, 2))  # none of those used up the one export


def test_trustlist_and_import_checks(acl):
    rt = acl.rt
    _fails(ACL_PARAM, "pid_list is NULL", rt.mem_set_pid_to_shareable_handle, 0, None)
    _fails(ACL_PARAM, "pid_list is empty", rt.mem_set_pid_to_shareable_handle, 0, [])
    expect_fail(BAD_HANDLE, rt.mem_set_pid_to_shareable_handle, 0, [1])  # V1 leaves the handle to the runtime
    _fails(ACL_PARAM, "shareableHandle is NULL", rt.mem_set_pid_to_shareable_handle_v2, None, 9, None)
    _fails(ACL_PARAM, "pid_list is NULL", rt.mem_set_pid_to_shareable_handle_v2, 5, 9, None)
    _fails(ACL_PARAM, "pid_list is empty", rt.mem_set_pid_to_shareable_handle_v2, 5, 9, [])
    _fails(PARAM, "shareType=9", rt.mem_set_pid_to_shareable_handle_v2, 5, 9, [1])
    _fails(ACL_PARAM, "shareableHandle is NULL", rt.mem_import_from_shareable_handle_v2, None, 9, 1)
    _fails(ACL_PARAM, "flags=1", rt.mem_import_from_shareable_handle_v2, 5, 9, 1)
    _fails(PARAM, "shareType=9", rt.mem_import_from_shareable_handle_v2, 5, 9, 0)
    expect_fail(BAD_HANDLE, rt.mem_import_from_shareable_handle, 0, 0)  # V1: no acl-layer checks
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(rt.mem_import_from_shareable_handle_v2(5, 9, 0)))
    t.start()
    t.join()
    assert out == [(0, NO_CONTEXT)], "after the acl layer's checks, the current device (the runtime's 107002)"


# ---------------------------------------------------------------- other codes


@pytest.mark.parametrize("attr", [-1, 18, 100, (1 << 31) - 1])
def test_get_mem_info_attribute_outside_acl_rt_mem_attr_is_107016(acl, attr):
    msg = expect_fail(BAD_MEMORY_TYPE, acl.rt.get_mem_info, attr)
    assert "aclrtMemAttr" in msg


@pytest.mark.parametrize("attr", range(18))
def test_get_mem_info_takes_every_attribute(acl, attr):
    free, total, ret = acl.rt.get_mem_info(attr)
    assert ret == 0 and 0 <= free <= total


def test_acl_invalid_param_error_is_an_invalid_param_error():
    import vmmshare

    err = vmmshare.AclInvalidParamError("x")
    assert err.code == 100000 and isinstance(err, vmmshare.InvalidParamError) and isinstance(err, ValueError)
    assert vmmshare.InvalidMemoryTypeError("x").code == BAD_MEMORY_TYPE
    from vmmshare.errors import error_from_code

    assert type(error_from_code(100000, "m")) is vmmshare.AclInvalidParamError
    assert type(error_from_code(107016, "m")) is vmmshare.InvalidMemoryTypeError
