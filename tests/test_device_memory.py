"""aclrtMalloc / aclrtFree: device memory behind a plain pointer, made of the runtime's own physical allocation,
reservation and mapping (so IPC can export it), charged to the current device, kept out of the VMM calls."""

from __future__ import annotations

import threading

import pytest

from conftest import (
    ACL_PARAM,
    G2M,
    NO_CONTEXT,
    NO_MEMORY,
    PARAM,
    GiB,
    MiB,
    child_ok,
    desc,
    expect_fail,
    memfds,
    ok,
    perms_at,
    private_broker_env,
    read,
    write,
)
from vmmshare._process import runtime


@pytest.fixture
def blocks(acl):
    """acl.rt.malloc with the pointers freed at the end."""
    made: list[int] = []

    def malloc(size: int, policy: int = 0) -> int:
        p = ok(acl.rt.malloc(size, policy))
        made.append(p)
        return p

    yield malloc
    for p in made:
        acl.rt.free(p)


def test_malloc_gives_zeroed_read_write_device_memory(acl, blocks):
    before = acl.rt.get_mem_info(0)[0]
    p = blocks(1000)
    assert p % G2M == 0 and perms_at(p) == "rw-s"
    assert read(p, 1000) == bytes(1000)
    write(p, b"device memory")
    assert read(p, 13) == b"device memory"
    assert acl.rt.get_mem_info(0)[0] == before - G2M, "charged to the device, rounded up to its page size"
    assert acl.rt.mem_get_address_range(p + 10) == (p, G2M, 0)
    host = ok(acl.rt.malloc_host(64))
    ok(acl.rt.memcpy(host, 64, p, 13, acl.ACL_MEMCPY_DEVICE_TO_HOST))  # it is device memory
    assert read(host, 13) == b"device memory"
    expect_fail(PARAM, acl.rt.memcpy, host, 64, p, 13, acl.ACL_MEMCPY_HOST_TO_HOST)
    ok(acl.rt.free_host(host))


def test_free_gives_everything_back(acl):
    rt = runtime()
    fds, counts, free0 = memfds(), rt.counts(), acl.rt.get_mem_info(0)[0]
    p = ok(acl.rt.malloc(3 * MiB, 2))
    assert rt.counts()["device_blocks"] == counts["device_blocks"] + 1
    ok(acl.rt.free(p))
    assert memfds() == fds and rt.counts() == counts and acl.rt.get_mem_info(0)[0] == free0
    assert perms_at(p) is None
    expect_fail(PARAM, acl.rt.free, p)


@pytest.mark.parametrize(("policy", "page"), [(0, G2M), (1, G2M), (2, G2M), (3, G2M), (5, G2M), (6, GiB), (7, GiB),
                                              (0x1000, G2M), (0x100000 | 6, GiB), (99, G2M), (-1, G2M)])
def test_policies(acl, blocks, policy, page):
    """The page type of the policy's low byte (an unknown one is the default, HUGE_FIRST, as in the runtime)."""
    p = blocks(1, policy)
    assert acl.rt.mem_get_address_range(p) == (p, page, 0)


def test_acl_layer_checks(acl):
    rt = acl.rt
    expect_fail(ACL_PARAM, rt.malloc, 0, 0)
    expect_fail(ACL_PARAM, rt.malloc, (1 << 64) - 1, 0)  # size + padding overflows
    expect_fail(ACL_PARAM, rt.free, 0)
    expect_fail(ACL_PARAM, rt.free, None)
    expect_fail(PARAM, rt.malloc, -1, 0)
    expect_fail(PARAM, rt.malloc, 1, "0")
    expect_fail(PARAM, rt.free, 0x7000)
    expect_fail(NO_MEMORY, rt.malloc, 1 << 50, 0)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(rt.malloc(1, 0)))
    t.start()
    t.join()
    assert out == [(0, NO_CONTEXT)], "the current device's memory"
    for name in ("malloc_align32", "malloc_cached"):
        p = ok(getattr(rt, name)(64, 0))
        ok(rt.free(p))


def test_malloc_memory_is_not_a_vmm_mapping(acl, vmm, blocks):
    """Its pointer names memory the runtime holds: the VMM calls refuse it (107000, saying to use free), and a VMM
    handle cannot be mapped into it."""
    p = blocks(G2M)
    rt = acl.rt
    for fn, args in ((rt.unmap_mem, [p]), (rt.release_mem_address, [p]), (rt.mem_retain_allocation_handle, [p]),
                     (rt.mem_set_access, [p, G2M, [desc(3)]]), (rt.mem_get_access, [p, {"id": 0, "type": 1}])):
        msg = expect_fail(PARAM, fn, *args)
        assert "acl.rt.free" in msg, msg
    h = vmm.alloc()
    expect_fail(PARAM, rt.map_mem, p, G2M, 0, h, 0)
    assert read(p, 4) == bytes(4)
    expect_fail(PARAM, rt.free_host, p)
    vp = vmm.reserve()
    expect_fail(PARAM, rt.free, vp)  # a reservation is not a block either


def test_capacity_is_the_devices(tmp_path):
    child_ok(
        """
        ok(acl.rt.set_device(1))
        a = ok(acl.rt.malloc(6 * M, 0))
        assert acl.rt.malloc(4 * M, 0) == (0, 207001)
        assert acl.rt.get_mem_info(0) == (2 * M, 8 * M, 0)
        ok(acl.rt.free(a))
        b = ok(acl.rt.malloc(8 * M, 2))
        ok(acl.rt.free(b))
        """,
        private_broker_env(tmp_path, VMMSHARE_DEVICE_MEMORY="8M"),
    )
