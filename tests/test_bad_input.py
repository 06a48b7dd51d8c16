"""Bad input to every acl.rt memory call: wrong types, wrong arity, out-of-range numbers, unknown handles and pointers.

Every case must return the documented code (never raise, never crash) and leave a fresh, informative message.
"""

from __future__ import annotations

import copy
import ctypes
from types import SimpleNamespace
from typing import Any

import pytest

import vmmshare.acl as acl_module
from conftest import (
    ACL_PARAM,
    BAD_DEVICE,
    BAD_HANDLE,
    BAD_MEMORY_TYPE,
    G2M,
    NOT_SUPPORTED,
    PARAM,
    READWRITE,
    MiB,
    desc,
    expect_fail,
    loc,
    memfds,
    ok,
    perms_at,
    prop,
    read,
    write,
)

# Each memory call: a factory of valid arguments (from live objects) and the kind of each argument.
SPECS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "malloc_physical": (lambda o: [G2M, prop(), 0], ("size", "prop", "flags")),
    "free_physical": (lambda o: [o.h_free], ("handle",)),
    "mem_get_allocation_granularity": (lambda o: [prop(), 0], ("prop", "int")),
    "reserve_mem_address": (lambda o: [G2M, 0, 0, 0], ("size", "int", "expect_ptr", "flags")),
    "release_mem_address": (lambda o: [o.empty], ("ptr",)),
    "map_mem": (lambda o: [o.base, G2M, 0, o.h_free, 0], ("ptr", "size", "int", "handle", "flags")),
    "mem_map_no_access": (lambda o: [o.base, G2M, 0, o.h_free, 0], ("ptr", "size", "int", "handle", "flags")),
    "unmap_mem": (lambda o: [o.mptr], ("ptr",)),
    "mem_set_access": (lambda o: [o.mptr, G2M, [desc(READWRITE)]], ("ptr", "size", "desc_list")),
    "mem_get_access": (lambda o: [o.mptr, loc()], ("ptr", "location")),
    "mem_retain_allocation_handle": (lambda o: [o.mptr], ("ptr",)),
    "mem_get_allocation_properties_from_handle": (lambda o: [o.h_free], ("handle",)),
    "mem_get_address_range": (lambda o: [o.mptr], ("ptr",)),
    "malloc_host": (lambda o: [4096], ("size",)),
    "free_host": (lambda o: [o.host], ("ptr",)),
    "memcpy": (lambda o: [o.host, 4096, o.mptr, 4096, 4], ("ptr", "size", "ptr", "size", "int")),
    "memset": (lambda o: [o.mptr, 4096, 0, 4096], ("ptr", "size", "value", "size")),
    "get_mem_info": (lambda o: [0], ("int",)),
}
NUMERIC = {"size", "ptr", "handle", "flags", "int", "value", "expect_ptr"}
# (call, argument) where None is a C NULL that the acl layer itself refuses (100000, SPEC §4a)
ACL_NULL = {("malloc_physical", 1), ("free_physical", 0), ("mem_get_allocation_granularity", 0),
            ("release_mem_address", 0), ("map_mem", 0), ("map_mem", 3), ("mem_map_no_access", 0),
            ("mem_map_no_access", 3), ("unmap_mem", 0), ("mem_get_access", 0), ("mem_get_access", 1),
            ("mem_retain_allocation_handle", 0), ("mem_get_allocation_properties_from_handle", 0),
            ("mem_get_address_range", 0), ("free_host", 0), ("memcpy", 0), ("memcpy", 2), ("memset", 0)}

BAD_TYPES = {
    "str": "1",
    "float": 1.0,
    "None": None,
    "bool": True,
    "list": [1],
    "dict": {"x": 1},
    "bytes": b"\x01",
}


def _cases_bad_type():
    for name, (_, kinds) in SPECS.items():
        for i, kind in enumerate(kinds):
            for tname in BAD_TYPES:
                if tname == "None" and kind == "expect_ptr":
                    continue  # None is NULL there: the system chooses (a valid call)
                yield pytest.param(name, i, tname, id=f"{name}-arg{i}-{tname}")


def _cases_bad_number():
    for name, (_, kinds) in SPECS.items():
        for i, kind in enumerate(kinds):
            if kind not in NUMERIC:
                continue
            for value in (-1, 1 << 64, 1 << 70, -(1 << 64)):
                if kind == "value" and value == -1:
                    continue  # memset takes an int value; only its low byte is used
                yield pytest.param(name, i, value, id=f"{name}-arg{i}-{value}")


@pytest.fixture
def live(vmm):
    """Live objects for the valid argument lists; the calls under test must not change them."""
    o = SimpleNamespace()
    o.h_free = vmm.alloc()
    o.base = vmm.reserve(8 * MiB)
    o.empty = vmm.reserve()
    o.h_mapped = vmm.alloc()
    o.mptr = vmm.map(o.base + 4 * MiB, G2M, o.h_mapped)
    o.host = vmm.host(4096)
    write(o.mptr, b"canary")
    return o


def _assert_untouched(vmm, o) -> None:
    assert read(o.mptr, 6) == b"canary"
    assert vmm.rt.mem_get_address_range(o.mptr) == (o.mptr, G2M, 0)
    assert ok(vmm.rt.mem_get_access(o.mptr, loc())) == READWRITE
    assert ok(vmm.rt.mem_get_allocation_properties_from_handle(o.h_free)) == prop()
    assert perms_at(o.base) == "---p"


@pytest.mark.parametrize("name", list(SPECS))
def test_valid_arguments_succeed(vmm, live, name):
    """The baseline the bad-input cases differ from: each call succeeds with these arguments."""
    result = getattr(acl_module.rt, name)(*SPECS[name][0](live))
    out = ok(result)
    if name == "malloc_physical":
        vmm.handles.append(out)
    elif name == "reserve_mem_address":
        vmm.reservations.append(out)
    elif name in ("map_mem", "mem_map_no_access"):
        vmm.mappings.append(live.base)
    elif name == "malloc_host":
        vmm.host_blocks.append(out)
    elif name == "mem_retain_allocation_handle":
        assert out == live.h_mapped
        ok(vmm.rt.free_physical(out))


@pytest.mark.parametrize(("name", "pos", "tname"), list(_cases_bad_type()))
def test_wrong_type_is_107000(vmm, live, name, pos, tname):
    """A wrong type is 107000; None is NULL, which the acl layer refuses itself (100000) where §4a says so."""
    args = SPECS[name][0](live)
    args[pos] = copy.deepcopy(BAD_TYPES[tname])
    code = ACL_PARAM if tname == "None" and (name, pos) in ACL_NULL else PARAM
    expect_fail(code, getattr(acl_module.rt, name), *args)
    _assert_untouched(vmm, live)


@pytest.mark.parametrize(("name", "pos", "value"), list(_cases_bad_number()))
def test_negative_and_huge_numbers_are_107000(vmm, live, name, pos, value):
    """107000; but get_mem_info(-1) is an int attribute outside aclrtMemAttr, 107016 as the runtime says."""
    args = SPECS[name][0](live)
    args[pos] = value
    code = BAD_MEMORY_TYPE if (name, value) == ("get_mem_info", -1) else PARAM
    if (name, pos, value) == ("memcpy", 4, -1):
        code = ACL_PARAM  # a kind outside aclrtMemcpyKind: the acl layer's MemcpyKindTranslate (SPEC §4a)
    expect_fail(code, getattr(acl_module.rt, name), *args)
    _assert_untouched(vmm, live)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("arity", ["too-few", "too-many", "bad-keyword", "none"])
def test_wrong_argument_count_is_107000(vmm, live, name, arity):
    args = SPECS[name][0](live)
    fn = getattr(acl_module.rt, name)
    if arity == "too-few":
        expect_fail(PARAM, fn, *args[:-1])
    elif arity == "too-many":
        expect_fail(PARAM, fn, *args, 0)
    elif arity == "bad-keyword":
        expect_fail(PARAM, fn, *args, no_such_argument=1)
    else:
        expect_fail(PARAM, fn)
    _assert_untouched(vmm, live)


# ---------------------------------------------------------------- structs: prop, desc_list, location

PROP_PATHS = ["handleType", "allocationType", "memAttr", "location", "location.type", "location.id"]


def _set_path(struct: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(struct)
    keys = path.split(".")
    target = out
    for k in keys[:-1]:
        target = target[k]
    target[keys[-1]] = value
    return out


def _drop_path(struct: dict[str, Any], path: str) -> dict[str, Any]:
    out = copy.deepcopy(struct)
    keys = path.split(".")
    target = out
    for k in keys[:-1]:
        target = target[k]
    del target[keys[-1]]
    return out


@pytest.mark.parametrize("fn_name", ["malloc_physical", "mem_get_allocation_granularity"])
@pytest.mark.parametrize("path", [*PROP_PATHS, "reserve"])
@pytest.mark.parametrize("tname", list(BAD_TYPES))
def test_prop_field_of_wrong_type_is_107000(acl, fn_name, path, tname):
    bad = _set_path(prop(), path, copy.deepcopy(BAD_TYPES[tname]))
    args = [G2M, bad, 0] if fn_name == "malloc_physical" else [bad, 0]
    expect_fail(PARAM, getattr(acl.rt, fn_name), *args)


@pytest.mark.parametrize("fn_name", ["malloc_physical", "mem_get_allocation_granularity"])
@pytest.mark.parametrize("path", PROP_PATHS)
def test_prop_missing_field_is_107000(acl, fn_name, path):
    bad = _drop_path(prop(), path)
    args = [G2M, bad, 0] if fn_name == "malloc_physical" else [bad, 0]
    msg = expect_fail(PARAM, getattr(acl.rt, fn_name), *args)
    assert path.split(".")[-1] in msg


@pytest.mark.parametrize(
    ("path", "value", "malloc_code", "granularity_code"),
    [  # malloc_physical's acl layer checks the types and locations; both check the attribute (SPEC §4a)
        ("handleType", 1, ACL_PARAM, PARAM),
        ("handleType", 3, ACL_PARAM, PARAM),
        ("allocationType", 1, ACL_PARAM, PARAM),
        ("memAttr", 18, ACL_PARAM, ACL_PARAM),
        ("memAttr", -1, PARAM, PARAM),
        ("memAttr", 1 << 64, PARAM, PARAM),
        ("location.type", 5, PARAM, PARAM),
        ("location.type", -1, PARAM, PARAM),
        ("location.type", 2, ACL_PARAM, NOT_SUPPORTED),
        ("location.type", 3, ACL_PARAM, NOT_SUPPORTED),
        ("location.id", 1 << 20, BAD_DEVICE, BAD_DEVICE),
        ("location.id", -1, BAD_DEVICE, BAD_DEVICE),
        ("reserve", 1, PARAM, PARAM),
    ],
)
@pytest.mark.parametrize("fn_name", ["malloc_physical", "mem_get_allocation_granularity"])
def test_prop_field_out_of_range(acl, fn_name, path, value, malloc_code, granularity_code):
    bad = _set_path(prop(), path, value)
    args = [G2M, bad, 0] if fn_name == "malloc_physical" else [bad, 0]
    expect_fail(malloc_code if fn_name == "malloc_physical" else granularity_code, getattr(acl.rt, fn_name), *args)


@pytest.mark.parametrize(
    "desc_list",
    [
        [],
        (),
        [1],
        [None],
        [{"flags": 3}],
        [{"location": loc()}],
        [{"flags": "3", "location": loc()}],
        [{"flags": 3.0, "location": loc()}],
        [{"flags": None, "location": loc()}],
        [{"flags": 3, "location": None}],
        [{"flags": 3, "location": [1, 0]}],
        [{"flags": 3, "location": {"type": 1}}],
        [{"flags": 3, "location": {"id": 0}}],
        [{"flags": 3, "location": {"type": "1", "id": 0}}],
        [{"flags": 3, "location": {"type": 1, "id": "0"}}],
        [{"flags": 3, "location": {"type": 9, "id": 0}}],
        [desc(READWRITE), {"flags": 2, "location": loc()}],
    ],
    ids=lambda v: repr(v)[:60],
)
def test_bad_desc_list_is_107000(vmm, live, desc_list):
    expect_fail(PARAM, vmm.rt.mem_set_access, live.mptr, G2M, desc_list)
    _assert_untouched(vmm, live)


def test_desc_list_with_bad_device_is_107001(vmm, live):
    expect_fail(BAD_DEVICE, vmm.rt.mem_set_access, live.mptr, G2M, [desc(READWRITE, dev=1 << 20)])
    expect_fail(BAD_DEVICE, vmm.rt.mem_get_access, live.mptr, loc(dev=-1))
    _assert_untouched(vmm, live)


@pytest.mark.parametrize(
    "location",
    [None, [], 1, {}, {"type": 1}, {"id": 0}, {"type": "1", "id": 0}, {"type": 1, "id": 1.0}, {"type": 7, "id": 0}],
    ids=repr,
)
def test_bad_location_for_get_access_is_107000(vmm, live, location):
    """107000; None is a NULL location, which the acl layer refuses itself (100000)."""
    expect_fail(ACL_PARAM if location is None else PARAM, vmm.rt.mem_get_access, live.mptr, location)


# ---------------------------------------------------------------- unknown handles and pointers

HANDLE_CALLS = {
    "free_physical": lambda o, h: [h],
    "mem_get_allocation_properties_from_handle": lambda o, h: [h],
    "map_mem": lambda o, h: [o.base, G2M, 0, h, 0],
    "mem_map_no_access": lambda o, h: [o.base, G2M, 0, h, 0],
}


@pytest.mark.parametrize("name", list(HANDLE_CALLS))
@pytest.mark.parametrize("which", ["freed", "made-up", "max-u64", "pointer-not-handle", "one"])
def test_unknown_handle_is_107017(vmm, live, name, which):
    if which == "freed":
        h = vmm.alloc()
        vmm.free(h)
    else:
        h = {"made-up": 0x7A00_0BAD_F00D, "max-u64": (1 << 64) - 1, "pointer-not-handle": live.mptr, "one": 1}[which]
    expect_fail(BAD_HANDLE, getattr(vmm.rt, name), *HANDLE_CALLS[name](live, h))
    _assert_untouched(vmm, live)


POINTER_CALLS = {
    "unmap_mem": lambda p: [p],
    "release_mem_address": lambda p: [p],
    "mem_set_access": lambda p: [p, G2M, [desc(READWRITE)]],
    "mem_get_access": lambda p: [p, loc()],
    "mem_retain_allocation_handle": lambda p: [p],
    "mem_get_address_range": lambda p: [p],
    "free_host": lambda p: [p],
    "memset": lambda p: [p, 16, 0, 16],
    "memcpy-dst": lambda p: [p, 16, "HOST", 16, 4],
    "memcpy-src": lambda p: ["HOST", 16, p, 16, 4],
}


def _pointer(o, vmm, which: str, keep: list[Any]) -> int:
    if which == "null":
        return 0
    if which == "low":
        return 4096
    if which == "released":
        p = vmm.reserve()
        vmm.release(p)
        return p
    if which == "reserved":
        return o.base
    if which == "python-memory":
        buf = bytearray(4 * MiB)
        keep.append(buf)
        return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) + G2M & ~(G2M - 1)
    if which == "kernel":
        return 0xFFFF_8000_0000_0000
    if which == "top":
        return (1 << 64) - G2M
    raise AssertionError(which)


def _cases_pointer():
    for name in POINTER_CALLS:
        for which in ("null", "low", "released", "reserved", "python-memory", "kernel", "top"):
            if which == "python-memory" and name in ("memset", "memcpy-dst", "memcpy-src"):
                continue  # plain process memory is valid host memory for copies
            yield pytest.param(name, which, id=f"{name}-{which}")


ACL_NULL_PTR = {"unmap_mem", "release_mem_address", "mem_get_access", "mem_retain_allocation_handle",
                "mem_get_address_range", "free_host", "memset", "memcpy-dst",
                "memcpy-src"}  # NULL is the acl layer's refusal there (100000, SPEC §4a)


@pytest.mark.parametrize(("name", "which"), list(_cases_pointer()))
def test_unknown_pointer_is_107000(vmm, live, name, which):
    keep: list[Any] = []
    p = _pointer(live, vmm, which, keep)
    args = [live.host if a == "HOST" else a for a in POINTER_CALLS[name](p)]
    fn = getattr(vmm.rt, name.split("-")[0])
    expect_fail(ACL_PARAM if which == "null" and name in ACL_NULL_PTR else PARAM, fn, *args)
    _assert_untouched(vmm, live)


@pytest.mark.parametrize(
    ("name", "offset"),
    [("unmap_mem", 4096), ("unmap_mem", MiB), ("release_mem_address", G2M), ("release_mem_address", 4 * MiB),
     ("free_host", 16), ("free_host", 4095)],
)
def test_pointer_inside_but_not_at_the_start_is_107000(vmm, live, name, offset):
    start = {"unmap_mem": live.mptr, "release_mem_address": live.empty, "free_host": live.host}[name]
    if name == "release_mem_address" and offset >= G2M:
        start = live.base
    expect_fail(PARAM, getattr(vmm.rt, name), start + offset)
    _assert_untouched(vmm, live)


# ---------------------------------------------------------------- lifecycle misuse


def test_double_free_physical_is_107017(vmm):
    h = vmm.alloc()
    vmm.free(h)
    msg = expect_fail(BAD_HANDLE, vmm.rt.free_physical, h)
    assert f"{h:x}" in msg.lower()
    expect_fail(BAD_HANDLE, vmm.rt.free_physical, h)


def test_free_while_mapped_is_ok_and_memory_stays(vmm):
    fds = set(memfds())
    p, h = vmm.mapped()
    write(p, b"alive")
    vmm.free(h)
    expect_fail(BAD_HANDLE, vmm.rt.free_physical, h)
    assert read(p, 5) == b"alive"
    ok(vmm.rt.memset(p, G2M, 0x11, G2M))
    assert read(p + G2M - 1, 1) == b"\x11"
    assert len(set(memfds()) - fds) == 1
    vmm.unmap(p)
    assert set(memfds()) == fds


def test_overlapping_map_is_107000(vmm):
    h1, h2 = vmm.alloc(4 * MiB), vmm.alloc(4 * MiB)
    base = vmm.reserve(8 * MiB)
    vmm.map(base + G2M, 4 * MiB, h1)
    for ptr in (base, base + G2M, base + 4 * MiB):
        expect_fail(PARAM, vmm.rt.map_mem, ptr, 4 * MiB, 0, h2, 0)
    expect_fail(PARAM, vmm.rt.map_mem, base + G2M, 4 * MiB, 0, h1, 0)  # the same allocation again, same place


def test_release_while_mapped_is_107000(vmm):
    p, _h = vmm.mapped()
    expect_fail(PARAM, vmm.rt.release_mem_address, p)
    assert perms_at(p) == "rw-s"


def test_double_unmap_and_double_release_are_107000(vmm):
    p, _h = vmm.mapped()
    vmm.unmap(p)
    expect_fail(PARAM, vmm.rt.unmap_mem, p)
    vmm.release(p)
    expect_fail(PARAM, vmm.rt.release_mem_address, p)


def test_double_free_host_is_107000(vmm):
    p = vmm.host(8192)
    ok(vmm.rt.free_host(p))
    vmm.host_blocks.remove(p)
    expect_fail(PARAM, vmm.rt.free_host, p)


def test_map_after_release_is_107000(vmm):
    h = vmm.alloc()
    p = vmm.reserve()
    vmm.release(p)
    expect_fail(PARAM, vmm.rt.map_mem, p, G2M, 0, h, 0)
    assert perms_at(p) is None


def test_failed_calls_do_not_raise_for_unhashable_or_odd_objects(acl):
    class Weird:
        def __index__(self) -> int:
            raise RuntimeError("boom")

        def __eq__(self, other: object) -> bool:
            raise RuntimeError("boom")

        __hash__ = None  # type: ignore[assignment]

    for fn, args in (
        (acl.rt.malloc_physical, [Weird(), prop(), 0]),
        (acl.rt.free_physical, [Weird()]),
        (acl.rt.reserve_mem_address, [G2M, 0, Weird(), 0]),
        (acl.rt.mem_get_access, [Weird(), {"type": Weird(), "id": 0}]),
    ):
        expect_fail(PARAM, fn, *args)
