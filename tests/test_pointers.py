"""Rule 18: what a pointer is (aclrtPointerGetAttributes), a reservation without UC memory, host memory registered
for the device, and batched copies (aclrtMemcpyBatch), with the runtime's codes for bad input."""

from __future__ import annotations

import ctypes
import mmap
import threading

import pytest

from conftest import ACL_PARAM, G2M, HOST, NO_CONTEXT, NOT_SUPPORTED, PARAM, expect_fail, ok, read, surface_acl, write
from vmmshare.backends import mman

DEVICE_LOC, UNREGISTERED = 1, 2
SIZE_MAX = (1 << 64) - 1
ALREADY_REGISTERED, NOT_REGISTERED = 507910, 507911
H2D = {"dstLoc": {"id": 0, "type": DEVICE_LOC}, "srcLoc": {"id": 0, "type": HOST}}
LIBC = ctypes.CDLL(None, use_errno=True)
D2H = {"dstLoc": {"id": 0, "type": HOST}, "srcLoc": {"id": 0, "type": DEVICE_LOC}}


@pytest.fixture(params=["python", "c"])
def acl(request):
    """Each test runs on both surfaces: vmmshare.acl, and the C library (libascendcl.so) through `cacl`."""
    yield from surface_acl(request.param)


def in_thread(fn, *args):
    """fn(*args) in a fresh thread, which has no current context."""
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(fn(*args)))
    t.start()
    t.join()
    return box[0]


# ---------------------------------------------------------------- pointer attributes


def test_rule_18_attributes_of_ordinary_host_memory_are_unregistered(acl):
    buf = ctypes.create_string_buffer(100)
    attrs = ok(acl.rt.pointer_get_attributes(ctypes.addressof(buf)))
    assert attrs == {"location": {"id": 0, "type": UNREGISTERED}, "pageSize": mmap.PAGESIZE}


def test_rule_18_attributes_say_host_device_and_page_size(acl, vmm):
    host = vmm.host(4096)
    assert ok(acl.rt.pointer_get_attributes(host + 10)) == {"location": {"id": 0, "type": HOST},
                                                            "pageSize": mmap.PAGESIZE}
    dev = ok(acl.rt.malloc(100, 0))
    try:
        got = ok(acl.rt.pointer_get_attributes(dev + 99))
        assert got == {"location": {"id": 0, "type": DEVICE_LOC}, "pageSize": G2M}  # HUGE_FIRST: 2 MiB pages
    finally:
        ok(acl.rt.free(dev))
    ptr, _ = vmm.mapped(G2M, attr=12, loc_type=HOST)  # ACL_MEM_NORMAL host memory: normal pages
    assert ok(acl.rt.pointer_get_attributes(ptr)) == {"location": {"id": 0, "type": HOST},
                                                      "pageSize": mmap.PAGESIZE}
    ptr, _ = vmm.mapped(G2M, attr=13)  # ACL_MEM_HUGE device memory
    assert ok(acl.rt.pointer_get_attributes(ptr + 1)) == {"location": {"id": 0, "type": DEVICE_LOC}, "pageSize": G2M}


def test_rule_18_attributes_of_a_reserved_unmapped_range_and_null(acl, vmm):
    p = vmm.reserve(G2M)
    assert "reserved but not mapped" in expect_fail(PARAM, acl.rt.pointer_get_attributes, p)
    expect_fail(ACL_PARAM, acl.rt.pointer_get_attributes, 0)
    expect_fail(PARAM, acl.rt.pointer_get_attributes, "0x10")


# ---------------------------------------------------------------- reservations without UC memory


def test_rule_18_reserve_no_uc_memory_is_a_reservation(acl, vmm):
    p = ok(acl.rt.reserve_mem_address_no_uc_memory(G2M, 0, 0, 1))
    vmm.reservations.append(p)
    h = vmm.alloc(G2M)
    vmm.map(p, G2M, h)
    write(p, b"no-uc")
    assert read(p, 5) == b"no-uc"
    vmm.unmap(p)
    vmm.release(p)
    expect_fail(ACL_PARAM, acl.rt.reserve_mem_address_no_uc_memory, 0, 0, 0, 0)
    expect_fail(ACL_PARAM, acl.rt.reserve_mem_address_no_uc_memory, G2M, 0, 0, 2)
    expect_fail(PARAM, acl.rt.reserve_mem_address_no_uc_memory, G2M + 1, 0, 0, 0)


# ---------------------------------------------------------------- host registration


def test_rule_18_host_register_gives_the_device_a_pointer(acl, vmm):
    buf = ctypes.create_string_buffer(8192)
    host = ctypes.addressof(buf)
    dev = ok(acl.rt.host_register(host, 8192, 0))
    try:
        assert ok(acl.rt.host_get_device_pointer(host, 0)) == dev
        assert ok(acl.rt.pointer_get_attributes(host + 5))["location"]["type"] == HOST  # registered: host memory
        block = ok(acl.rt.malloc(64, 0))
        try:  # the device reads and writes the registered memory through its pointer
            buf[0:4] = b"regd"
            ok(acl.rt.memcpy(block, 64, dev, 4, 4))  # ACL_MEMCPY_DEFAULT
            ok(acl.rt.memcpy(dev + 100, 64, block, 4, 4))
            assert buf[100:104] == b"regd"
        finally:
            ok(acl.rt.free(block))
        assert "registered already" in expect_fail(ALREADY_REGISTERED, acl.rt.host_register, host + 4096, 10, 0)
        expect_fail(PARAM, acl.rt.host_get_device_pointer, host + 1, 0)  # by the base pointer only
        expect_fail(NOT_REGISTERED, acl.rt.host_unregister, host + 1)
    finally:
        ok(acl.rt.host_unregister(host))
    expect_fail(NOT_REGISTERED, acl.rt.host_unregister, host)
    expect_fail(PARAM, acl.rt.host_get_device_pointer, host, 0)
    assert ok(acl.rt.pointer_get_attributes(host))["location"]["type"] == UNREGISTERED


def test_rule_18_host_register_bad_input(acl):
    buf = ctypes.create_string_buffer(4096)
    host = ctypes.addressof(buf)
    expect_fail(ACL_PARAM, acl.rt.host_register, 0, 10, 0)
    expect_fail(ACL_PARAM, acl.rt.host_register, host, 0, 0)
    expect_fail(NOT_SUPPORTED, acl.rt.host_register, host, 10, 0x2)  # only IOMEMORY and READONLY bits
    expect_fail(ACL_PARAM, acl.rt.host_get_device_pointer, host, 1)  # flag is reserved
    expect_fail(ACL_PARAM, acl.rt.host_get_device_pointer, 0, 0)
    expect_fail(ACL_PARAM, acl.rt.host_unregister, 0)
    base = mman.map_anonymous(mmap.PAGESIZE)
    try:
        assert LIBC.mprotect(ctypes.c_void_p(base), mmap.PAGESIZE, mmap.PROT_READ) == 0  # readable, not writable
        assert "not writable" in expect_fail(PARAM, acl.rt.host_register, base, mmap.PAGESIZE, 0)
        dev = ok(acl.rt.host_register(base, mmap.PAGESIZE, 0x8))  # READONLY asks for readable memory only
        ok(acl.rt.host_unregister(dev))
    finally:
        mman.unmap(base, mmap.PAGESIZE)
    code = in_thread(acl.rt.host_register, host, 10, 0)
    assert code[-1] == NO_CONTEXT


# ---------------------------------------------------------------- batched copies


def test_rule_18_memcpy_batch_copies_many_blocks_both_ways(acl, vmm):
    dev = ok(acl.rt.malloc(64 * 1024, 0))
    host = vmm.host(64 * 1024)
    try:
        blocks = [bytes([i]) * 100 for i in range(16)]
        for i, data in enumerate(blocks):
            write(host + i * 4096, data)
        dsts = [dev + i * 4096 for i in range(16)]
        srcs = [host + i * 4096 for i in range(16)]
        assert acl.rt.memcpy_batch(dsts, [4096] * 16, srcs, [100] * 16, 16, [H2D], [0], 1) == (SIZE_MAX, 0)
        # back, into the second half of each host page, with two attributes over the batch (the same direction)
        back = [s + 2048 for s in srcs]
        assert acl.rt.memcpy_batch(back, [2048] * 16, dsts, [100] * 16, 16, [D2H, D2H], [0, 8], 2) == (SIZE_MAX, 0)
        for i, data in enumerate(blocks):
            assert read(back[i], 100) == data
        # ordinary host memory (unregistered) is host memory to the batch
        buf = ctypes.create_string_buffer(100)
        assert acl.rt.memcpy_batch([ctypes.addressof(buf)], [100], [dsts[3]], [100], 1, [D2H], [0], 1)[1] == 0
        assert buf.raw == blocks[3]
    finally:
        ok(acl.rt.free(dev))


def test_rule_18_memcpy_batch_names_the_pair_that_fails(acl, vmm):
    dev = ok(acl.rt.malloc(8192, 0))
    host = vmm.host(8192)
    try:
        # pair 2 claims host->device but goes host->host: it is named, and nothing of the batch was copied
        write(dev, b"\0" * 8)
        write(host, b"batched!")
        dsts, srcs = [dev, dev + 16, host + 4096], [host, host + 16, host + 32]
        fail, ret = acl.rt.memcpy_batch(dsts, [8] * 3, srcs, [8] * 3, 3, [H2D], [0], 1)
        assert (fail, ret) == (2, PARAM)
        assert "pair 2" in acl.get_recent_err_msg()
        assert read(dev, 8) == b"\0" * 8
        # a host->host copy whose attribute says so is refused too: the batch copies between host and device only
        same = {"dstLoc": {"id": 0, "type": HOST}, "srcLoc": {"id": 0, "type": HOST}}
        assert acl.rt.memcpy_batch([host + 4096], [8], [host], [8], 1, [same], [0], 1) == (0, PARAM)
        # the device id must match a device side
        other = {"dstLoc": {"id": 1, "type": DEVICE_LOC}, "srcLoc": {"id": 0, "type": HOST}}
        assert acl.rt.memcpy_batch([dev], [8], [host], [8], 1, [other], [0], 1) == (0, PARAM)
    finally:
        ok(acl.rt.free(dev))


def test_rule_18_memcpy_batch_bad_input(acl, vmm):
    host = vmm.host(8192)
    mb = acl.rt.memcpy_batch

    def code(*args):
        fail, ret = mb(*args)
        assert fail == SIZE_MAX or ret == 0, (fail, ret)
        assert ret == 0 or any(name in acl.get_recent_err_msg() for name in ("memcpy_batch", "aclrtMemcpyBatch"))
        return ret

    # sizes all 0: success before any other check, even with NULL arrays
    assert mb(None, None, None, [0, 0], 2, None, None, 0) == (SIZE_MAX, 0)
    assert code([host], [8], [host], None, 1, [H2D], [0], 1) == ACL_PARAM  # sizes NULL
    assert code([host], [8], [host], [8], 0, [H2D], [0], 1) == ACL_PARAM  # numBatches 0
    assert code(None, [8], [host], [8], 1, [H2D], [0], 1) == ACL_PARAM  # dsts NULL
    assert code([host], [4], [host], [8], 1, [H2D], [0], 1) == ACL_PARAM  # destMax below size
    assert code([host], [8], [host], [8], 1, [{**H2D, "rsv": [1]}], [0], 1) == ACL_PARAM  # rsv not 0
    assert code([host], [8], [host], [8], 1, [H2D], [0], 0) == PARAM  # numAttrs 0
    assert code([host], [8], [host], [8], 1, [H2D, H2D], [0, 1], 2) == PARAM  # more attributes than copies
    assert code([host] * 2, [8] * 2, [host] * 2, [8] * 2, 2, [H2D], [1], 1) == PARAM  # the first index is not 0
    assert code([host] * 3, [8] * 3, [host] * 3, [8] * 3, 3, [H2D, H2D], [0, 0], 2) == PARAM  # not increasing
    n = 4097
    assert code([host] * n, [8] * n, [host] * n, [8] * n, n, [H2D], [0], 1) == PARAM  # over the driver's 4096
    assert code([host], [8], [host], [8], 2, [H2D], [0], 1) == PARAM  # arrays shorter than numBatches
    assert code([host], [8], [host], [8], 1, [{"dstLoc": {}}], [0], 1) == PARAM  # an attribute without fields
