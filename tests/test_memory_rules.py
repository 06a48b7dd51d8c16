"""SPEC §4 rules 1-8: granularity, physical memory, reservations, mappings, access, unmapping, aliasing, retain."""

from __future__ import annotations

import ctypes
import os

import pytest

from conftest import (
    ACL_PARAM,
    ARENA_END,
    ARENA_START,
    BAD_DEVICE,
    BAD_HANDLE,
    DEVICE,
    G2M,
    HOST,
    NONE,
    NOT_SUPPORTED,
    PARAM,
    READ,
    READWRITE,
    SIGSEGV_RC,
    GiB,
    MiB,
    child_ok,
    desc,
    expect_fail,
    fd_count,
    loc,
    memfds,
    ok,
    perms_at,
    perms_over,
    private_broker_env,
    prop,
    read,
    rss_kb,
    run_child,
    surface_acl,
    write,
)
from vmmshare.constants import DDR_MEM_ATTRS, HUGE1G_ATTRS, PHYSICAL_MEM_ATTRS

DEVICE_ATTRS = sorted(PHYSICAL_MEM_ATTRS - DDR_MEM_ATTRS)  # the attributes a DEVICE location takes (SPEC §4a)


@pytest.fixture(params=["python", "c"])
def acl(request):
    """Each rule runs on both surfaces: vmmshare.acl, and the C library (libascendcl.so) through `cacl`."""
    yield from surface_acl(request.param)


# ---------------------------------------------------------------- rule 1: granularity


@pytest.mark.parametrize("option", [0, 1])
@pytest.mark.parametrize("attr", DEVICE_ATTRS)
def test_rule_1_granularity_2mib_and_1gib(acl, attr, option):
    g = ok(acl.rt.mem_get_allocation_granularity(prop(attr), option))
    assert g == (GiB if attr in HUGE1G_ATTRS else G2M)
    assert {10, 11, 14, 17} == HUGE1G_ATTRS


def test_rule_1_granularity_is_the_same_for_host_location(acl):
    assert ok(acl.rt.mem_get_allocation_granularity(prop(12, loc_type=HOST), 0)) == G2M
    assert ok(acl.rt.mem_get_allocation_granularity(prop(2, loc_type=HOST), 1)) == G2M
    # 1 GiB pages are device memory only: the driver refuses them on the host (tests/test_acl_layer.py pins it)
    expect_fail(NOT_SUPPORTED, acl.rt.mem_get_allocation_granularity, prop(14, loc_type=HOST), 1)


@pytest.mark.parametrize("option", [2, 3, -1, 1 << 32])
def test_rule_1_granularity_option_must_be_0_or_1(acl, option):
    expect_fail(PARAM, acl.rt.mem_get_allocation_granularity, prop(), option)


@pytest.mark.parametrize("size", [0, 1, 4096, G2M - 1, G2M + 1, G2M + 4096, 3 * MiB, -G2M])
def test_rule_1_malloc_size_must_be_a_positive_multiple_of_2mib(acl, size):
    expect_fail(ACL_PARAM if size == 0 else PARAM, acl.rt.malloc_physical, size, prop(), 0)  # 0: the acl layer's


@pytest.mark.parametrize("size", [G2M, 4 * MiB, 16 * MiB])
def test_rule_1_malloc_accepts_multiples_of_2mib(vmm, size):
    h = vmm.alloc(size)
    got = ok(vmm.rt.mem_get_allocation_properties_from_handle(h))
    assert got == prop()


@pytest.mark.parametrize("attr", sorted(HUGE1G_ATTRS & PHYSICAL_MEM_ATTRS))
@pytest.mark.parametrize("size", [G2M, 512 * MiB, GiB + G2M])
def test_rule_1_huge1g_sizes_must_be_multiples_of_1gib(acl, attr, size):
    expect_fail(PARAM, acl.rt.malloc_physical, size, prop(attr), 0)


def test_rule_1_huge1g_allocation_of_1gib_is_lazy_and_works(vmm):
    before = vmm.rt.get_mem_info(0)
    h = vmm.alloc(GiB, attr=14)
    free_after, _total, ret = vmm.rt.get_mem_info(0)
    assert ret == 0 and free_after == before[0] - GiB
    vmm.free(h)
    assert vmm.rt.get_mem_info(0)[0] == before[0]


@pytest.mark.parametrize("flags", [1, 2, 0x100, -1])
def test_rule_1_malloc_flags_must_be_0(acl, flags):
    expect_fail(PARAM if flags < 0 else ACL_PARAM, acl.rt.malloc_physical, G2M, prop(), flags)  # -1: not a uint64


# ---------------------------------------------------------------- rule 2: physical memory is a memfd, capacity


def test_rule_2_one_memfd_per_allocation_closed_on_free(vmm):
    before = memfds()
    hs = [vmm.alloc() for _ in range(3)]
    new = set(memfds()) - set(before)
    assert len(new) == 3, f"expected one new memfd per allocation, got {memfds()}"
    for fd in new:
        assert os.fstat(fd).st_size == G2M
    for h in hs:
        vmm.free(h)
    assert set(memfds()) == set(before)


def test_rule_2_memory_is_committed_lazily(vmm):
    before = set(memfds())
    h = vmm.alloc(8 * MiB)
    (fd,) = set(memfds()) - before
    assert os.fstat(fd).st_blocks == 0, "a fresh allocation must not commit memory"
    p = vmm.reserve(8 * MiB)
    vmm.map(p, 8 * MiB, h)
    assert os.fstat(fd).st_blocks == 0, "mapping must not commit memory either"
    write(p + 4 * MiB, b"x" * 4096)
    blocks = os.fstat(fd).st_blocks
    assert 0 < blocks * 512 < 8 * MiB, "writing one page commits that page, not the whole allocation"


def test_rule_2_capacity_and_mem_info_track_allocations(vmm):
    free0, total, ret = vmm.rt.get_mem_info(0)
    assert ret == 0 and 0 < free0 <= total
    h = vmm.alloc(6 * MiB)
    assert vmm.rt.get_mem_info(0) == (free0 - 6 * MiB, total, 0)
    assert vmm.rt.get_mem_info(5) == (free0 - 6 * MiB, total, 0), "attr does not change the answer"
    vmm.free(h)
    assert vmm.rt.get_mem_info(0) == (free0, total, 0)


def test_rule_2_over_capacity_fails_207001_and_leaks_nothing(tmp_path):
    child_ok(
        """
        assert acl.rt.set_device(0) == 0
        free0, total, ret = acl.rt.get_mem_info(0)
        assert (free0, total, ret) == (16 * M, 16 * M, 0), (free0, total, ret)
        h1 = ok(acl.rt.malloc_physical(10 * M, P(0), 0))
        assert acl.rt.get_mem_info(0)[0] == 6 * M
        fds, counts = len(os.listdir("/proc/self/fd")), runtime().counts()
        for size in (8 * M, 32 * M, 1 << 40):
            for _ in range(20):
                h, ret = acl.rt.malloc_physical(size, P(0), 0)
                assert (h, ret) == (0, 207001), (size, h, ret)
                msg = acl.get_recent_err_msg()
                assert "malloc_physical" in msg and len(msg) > 20, msg
        assert len(os.listdir("/proc/self/fd")) == fds, "a failed allocation leaked an fd"
        assert runtime().counts() == counts, runtime().counts()
        assert acl.rt.get_mem_info(0)[0] == 6 * M, "a failed allocation was charged"
        h2 = ok(acl.rt.malloc_physical(6 * M, P(0), 0))      # exactly full is fine
        assert acl.rt.get_mem_info(0)[0] == 0
        assert acl.rt.malloc_physical(2 * M, P(0), 0) == (0, 207001)
        h3 = ok(acl.rt.malloc_physical(16 * M, P(1), 0))     # capacity is per device
        ok(acl.rt.free_physical(h2))
        h4 = ok(acl.rt.malloc_physical(4 * M, P(0), 0))      # freeing gives capacity back
        for h in (h1, h3, h4):
            ok(acl.rt.free_physical(h))
        assert acl.rt.get_mem_info(0) == (16 * M, 16 * M, 0)
        assert len(os.listdir("/proc/self/fd")) == fds - 1
        """,
        private_broker_env(tmp_path, VMMSHARE_DEVICE_MEMORY="16M"),
    )


# ---------------------------------------------------------------- rule 3: reservations


def test_rule_3_system_choice_is_in_the_arena_and_inaccessible(vmm):
    for expect in (0, None):
        p = ok(vmm.rt.reserve_mem_address(8 * MiB, 0, expect, 0))
        vmm.reservations.append(p)
        assert p >= ARENA_START and p + 8 * MiB <= ARENA_END
        assert p % G2M == 0
        assert perms_over(p, p + 8 * MiB) == {"---p"}
        assert rss_kb(p, p + 8 * MiB) == 0


def test_rule_3_large_reservation_commits_nothing(vmm):
    size = 64 * GiB
    p = vmm.reserve(size)
    assert perms_over(p, p + size) == {"---p"}
    assert rss_kb(p, p + size) == 0
    vmm.release(p)
    assert perms_at(p) is None


def test_rule_3_expect_ptr_is_honoured_exactly(vmm):
    p = vmm.reserve(4 * MiB)
    vmm.release(p)
    assert perms_at(p) is None
    q = vmm.reserve(4 * MiB, expect_ptr=p)
    assert q == p
    assert perms_over(p, p + 4 * MiB) == {"---p"}


def test_rule_3_expect_ptr_in_use_fails_never_moves(vmm):
    p = vmm.reserve(4 * MiB)
    for want in (p, p + G2M, p - G2M):
        msg = expect_fail(PARAM, vmm.rt.reserve_mem_address, 4 * MiB, 0, want, 0)
        assert f"{want:x}" in msg.lower()


def test_rule_3_expect_ptr_on_foreign_memory_fails(vmm):
    buf = ctypes.create_string_buffer(8 * MiB)
    want = (ctypes.addressof(buf) + G2M) & ~(G2M - 1)
    expect_fail(PARAM, vmm.rt.reserve_mem_address, G2M, 0, want, 0)
    assert buf.raw[:16] == bytes(16)


@pytest.mark.parametrize("offset", [4096, 1, MiB])
def test_rule_3_expect_ptr_must_be_2mib_aligned(vmm, offset):
    p = vmm.reserve(4 * MiB)
    vmm.release(p)
    expect_fail(PARAM, vmm.rt.reserve_mem_address, G2M, 0, p + offset, 0)


@pytest.mark.parametrize("size", [0, 1, 4096, G2M + 4096, -G2M])
def test_rule_3_size_must_be_a_positive_multiple_of_2mib(acl, size):
    expect_fail(ACL_PARAM if size == 0 else PARAM, acl.rt.reserve_mem_address, size, 0, 0, 0)  # 0: the acl layer's


@pytest.mark.parametrize("alignment", [1, 4096, G2M, GiB])
def test_rule_3_alignment_must_be_0(acl, alignment):
    expect_fail(PARAM, acl.rt.reserve_mem_address, G2M, alignment, 0, 0)


@pytest.mark.parametrize("flags", [2, 3, 0x100, -1])
def test_rule_3_flags_must_be_0(acl, flags):
    """0, or 1 for compatibility (it means 0); anything else is the acl layer's refusal (-1: not a uint64)."""
    expect_fail(PARAM if flags < 0 else ACL_PARAM, acl.rt.reserve_mem_address, G2M, 0, 0, flags)


def test_rule_3_flags_1_is_accepted_and_means_0(vmm):
    p = ok(vmm.rt.reserve_mem_address(G2M, 0, 0, 1))
    vmm.reservations.append(p)
    assert perms_at(p) == "---p"
    h = vmm.alloc()
    vmm.map(p, G2M, h)
    write(p, b"flags 1")
    assert read(p, 7) == b"flags 1"


def test_rule_3_one_reservation_holds_at_most_8_tib(vmm):
    """An A3 program's 32 TiB reservation is refused with 107000 and a message saying the limit and what to do;
    8 TiB is one reservation, committing nothing."""
    msg = expect_fail(PARAM, vmm.rt.reserve_mem_address, 32 << 40, 0, 0, 0)
    assert "8 TiB" in msg and "several ranges" in msg
    p = vmm.reserve(8 << 40)
    expect_fail(PARAM, vmm.rt.reserve_mem_address, 2 * MiB, 0, p, 0)  # the range is taken


def test_rule_3_release_gives_the_range_back(vmm):
    p = vmm.reserve(6 * MiB)
    vmm.release(p)
    assert perms_at(p) is None
    expect_fail(PARAM, vmm.rt.release_mem_address, p)


# ---------------------------------------------------------------- rule 4: mapping


def test_rule_4_mapped_memory_is_readable_and_writable(vmm):
    h = vmm.alloc(4 * MiB)
    base = vmm.reserve(8 * MiB)
    vmm.map(base + 2 * MiB, 4 * MiB, h)
    assert perms_over(base + 2 * MiB, base + 6 * MiB) == {"rw-s"}
    assert perms_at(base) == "---p" and perms_at(base + 6 * MiB) == "---p"
    assert read(base + 2 * MiB, 4096) == bytes(4096), "fresh memory reads zero"
    pattern = bytes(range(256)) * (4 * MiB // 256)
    write(base + 2 * MiB, pattern)
    assert read(base + 2 * MiB, 4 * MiB) == pattern


def test_rule_4_size_must_equal_the_allocation(vmm):
    h = vmm.alloc(4 * MiB)
    base = vmm.reserve(8 * MiB)
    for size in (G2M, 8 * MiB, 4 * MiB + 4096):
        expect_fail(PARAM, vmm.rt.map_mem, base, size, 0, h, 0)
    expect_fail(ACL_PARAM, vmm.rt.map_mem, base, 0, 0, h, 0)  # size 0: the acl layer's check
    vmm.map(base, 4 * MiB, h)


@pytest.mark.parametrize("offset", [1, 4096, G2M])
def test_rule_4_offset_must_be_0(vmm, offset):
    h = vmm.alloc(4 * MiB)
    base = vmm.reserve(8 * MiB)
    expect_fail(PARAM, vmm.rt.map_mem, base, 4 * MiB, offset, h, 0)
    expect_fail(PARAM, vmm.rt.mem_map_no_access, base, 4 * MiB, offset, h, 0)


@pytest.mark.parametrize("flags", [1, 2, -1])
def test_rule_4_flags_must_be_0(vmm, flags):
    h = vmm.alloc()
    base = vmm.reserve()
    code = PARAM if flags < 0 else ACL_PARAM  # the acl layer's check; -1 is not a uint64 at all
    expect_fail(code, vmm.rt.map_mem, base, G2M, 0, h, flags)
    expect_fail(code, vmm.rt.mem_map_no_access, base, G2M, 0, h, flags)


def test_rule_4_ptr_must_be_aligned_to_granularity(vmm):
    h = vmm.alloc()
    base = vmm.reserve(8 * MiB)
    for ptr in (base + 4096, base + 1, base + MiB):
        expect_fail(PARAM, vmm.rt.map_mem, ptr, G2M, 0, h, 0)
    assert perms_over(base, base + 8 * MiB) == {"---p"}


def test_rule_4_huge1g_mapping_needs_1gib_alignment(vmm):
    h = vmm.alloc(GiB, attr=10)
    base = vmm.reserve(2 * GiB)
    expect_fail(PARAM, vmm.rt.map_mem, base + G2M, GiB, 0, h, 0)
    aligned = base if base % GiB == 0 else base + GiB - base % GiB
    assert aligned + GiB <= base + 2 * GiB
    vmm.map(aligned, GiB, h)
    write(aligned + GiB - 8, b"lastpage")
    assert read(aligned + GiB - 8, 8) == b"lastpage"


def test_rule_4_range_must_lie_in_one_reservation(vmm):
    h = vmm.alloc(4 * MiB)
    a = vmm.reserve(G2M)
    vmm.release(a)
    first = vmm.reserve(G2M, expect_ptr=a)
    second = vmm.reserve(G2M, expect_ptr=a + G2M)
    assert (first, second) == (a, a + G2M)
    msg = expect_fail(PARAM, vmm.rt.map_mem, a, 4 * MiB, 0, h, 0)
    assert "reservation" in msg
    expect_fail(PARAM, vmm.rt.map_mem, a + G2M, 4 * MiB, 0, h, 0)  # runs past the second one


def test_rule_4_ptr_outside_any_reservation_fails(vmm):
    h = vmm.alloc()
    p = vmm.reserve()
    vmm.release(p)
    expect_fail(PARAM, vmm.rt.map_mem, p, G2M, 0, h, 0)
    assert perms_at(p) is None, "a failed map must not leave memory behind"
    buf = ctypes.create_string_buffer(4 * MiB)
    expect_fail(PARAM, vmm.rt.map_mem, (ctypes.addressof(buf) + G2M) & ~(G2M - 1), G2M, 0, h, 0)


def test_rule_4_overlapping_mappings_fail(vmm):
    h1, h2, h3 = vmm.alloc(4 * MiB), vmm.alloc(4 * MiB), vmm.alloc(G2M)
    base = vmm.reserve(8 * MiB)
    vmm.map(base, 4 * MiB, h1)
    write(base, b"first")
    for ptr, size, h in ((base + G2M, 4 * MiB, h2), (base, 4 * MiB, h2), (base + G2M, G2M, h3), (base, G2M, h3)):
        msg = expect_fail(PARAM, vmm.rt.map_mem, ptr, size, 0, h, 0)
        assert "overlap" in msg
    assert read(base, 5) == b"first", "a refused map must not replace the existing one"
    vmm.map(base + 4 * MiB, 4 * MiB, h2)  # adjacent is fine


def test_rule_4_unknown_handle_is_107017(vmm):
    base = vmm.reserve()
    h = vmm.alloc()
    vmm.free(h)
    for handle in (h, 0x7A00_DEAD_0000, 1 << 63):
        expect_fail(BAD_HANDLE, vmm.rt.map_mem, base, G2M, 0, handle, 0)
        expect_fail(BAD_HANDLE, vmm.rt.mem_map_no_access, base, G2M, 0, handle, 0)


def test_rule_4_map_no_access_is_inaccessible_until_set_access(vmm):
    h = vmm.alloc()
    p = vmm.reserve()
    vmm.map(p, G2M, h, no_access=True)
    assert perms_at(p) == "---s"
    assert ok(vmm.rt.mem_get_access(p, loc())) == NONE
    ok(vmm.rt.mem_set_access(p, G2M, [desc(READWRITE)]))
    assert perms_at(p) == "rw-s"
    write(p, b"now writable")
    assert read(p, 12) == b"now writable"


def test_rule_4_map_no_access_faults_on_read_in_a_child():
    proc = run_child(
        CHILD_FAULT.format(setup="ok(acl.rt.mem_map_no_access(p, 2 * M, 0, h, 0))", op="ctypes.string_at(p, 1)")
    )
    assert proc.returncode == SIGSEGV_RC, (proc.returncode, proc.stdout, proc.stderr)
    assert "ARMED" in proc.stdout and "SURVIVED" not in proc.stdout


# ---------------------------------------------------------------- rule 5: access flags

CHILD_FAULT = """
import ctypes
import vmmshare.acl as acl
def ok(r):
    assert (r[-1] if isinstance(r, tuple) else r) == 0, (r, acl.get_recent_err_msg())
    return r[0] if isinstance(r, tuple) and len(r) == 2 else r
M = 1 << 20
assert acl.rt.set_device(0) == 0
prop = {{"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {{"id": 0, "type": 1}}, "reserve": 0}}
h = ok(acl.rt.malloc_physical(2 * M, prop, 0))
p = ok(acl.rt.reserve_mem_address(2 * M, 0, 0, 0))
{setup}
print("ARMED", flush=True)
{op}
print("SURVIVED", flush=True)
"""

MAP_RW = "ok(acl.rt.map_mem(p, 2 * M, 0, h, 0)); ctypes.memset(p, 7, 4096)"


def _set_access(flags: int) -> str:
    return f"{MAP_RW}; ok(acl.rt.mem_set_access(p, 2 * M, [{{'flags': {flags}, 'location': {{'type': 1, 'id': 0}}}}]))"


@pytest.mark.parametrize(
    ("flags", "op", "faults"),
    [
        (READ, "ctypes.memset(p + 4096, 1, 1)", True),
        (READ, "assert ctypes.string_at(p, 1) == b'\\x07'", False),
        (NONE, "ctypes.string_at(p, 1)", True),
        (READWRITE, "ctypes.memset(p + 4096, 1, 1)", False),
    ],
    ids=["read-write-faults", "read-read-ok", "none-read-faults", "readwrite-write-ok"],
)
def test_rule_5_access_takes_effect_at_once_in_a_child(flags, op, faults):
    proc = run_child(CHILD_FAULT.format(setup=_set_access(flags), op=op))
    assert "ARMED" in proc.stdout, proc.stderr
    if faults:
        assert proc.returncode == SIGSEGV_RC, (proc.returncode, proc.stdout, proc.stderr)
        assert "SURVIVED" not in proc.stdout
    else:
        assert proc.returncode == 0 and "SURVIVED" in proc.stdout, (proc.returncode, proc.stderr)


def test_rule_5_set_and_get_access_round_trip(vmm):
    p, _h = vmm.mapped(4 * MiB)
    write(p, b"keep")
    assert ok(vmm.rt.mem_get_access(p, loc())) == READWRITE
    for flags, perms in ((READ, "r--s"), (NONE, "---s"), (READWRITE, "rw-s"), (READ, "r--s")):
        ok(vmm.rt.mem_set_access(p, 4 * MiB, [desc(flags)]))
        assert ok(vmm.rt.mem_get_access(p, loc())) == flags
        assert ok(vmm.rt.mem_get_access(p + 3 * MiB, loc())) == flags, "any address inside the mapping"
        assert perms_over(p, p + 4 * MiB) == {perms}
    assert read(p, 4) == b"keep", "changing access keeps the contents"
    ok(vmm.rt.mem_set_access(p, 4 * MiB, [desc(READWRITE)]))


def test_rule_5_read_mapping_refuses_acl_writes(vmm):
    p, _h = vmm.mapped()
    src = vmm.host(4096)
    ok(vmm.rt.mem_set_access(p, G2M, [desc(READ)]))
    expect_fail(PARAM, vmm.rt.memset, p, 4096, 1, 4096)
    expect_fail(PARAM, vmm.rt.memcpy, p, 4096, src, 4096, 1)
    ok(vmm.rt.memcpy(src, 4096, p, 4096, 2))  # reading is allowed


def test_rule_5_set_access_takes_exactly_the_mapped_range(vmm):
    h = vmm.alloc(4 * MiB)
    base = vmm.reserve(8 * MiB)
    vmm.map(base, 4 * MiB, h)
    for ptr, size in ((base, G2M), (base, 8 * MiB), (base + G2M, G2M), (base + 4 * MiB, 4 * MiB), (base, 0)):
        expect_fail(PARAM, vmm.rt.mem_set_access, ptr, size, [desc(READ)])
    assert ok(vmm.rt.mem_get_access(base, loc())) == READWRITE
    assert perms_over(base, base + 4 * MiB) == {"rw-s"}


@pytest.mark.parametrize("flags", [2, 4, 7, 0xFF, -1])
def test_rule_5_unknown_access_flags_fail(vmm, flags):
    p, _h = vmm.mapped()
    expect_fail(PARAM, vmm.rt.mem_set_access, p, G2M, [desc(flags)])
    assert ok(vmm.rt.mem_get_access(p, loc())) == READWRITE


def test_rule_5_get_access_outside_a_mapping_fails(vmm):
    p = vmm.reserve()
    expect_fail(PARAM, vmm.rt.mem_get_access, p, loc())
    expect_fail(PARAM, vmm.rt.mem_set_access, p, G2M, [desc(READ)])


# ---------------------------------------------------------------- rule 6: unmap, release, free while mapped


def test_rule_6_unmap_returns_the_range_to_reserved(vmm):
    h = vmm.alloc()
    p = vmm.reserve()
    vmm.map(p, G2M, h)
    write(p, b"survives unmap")
    vmm.unmap(p)
    assert perms_over(p, p + G2M) == {"---p"}
    assert rss_kb(p, p + G2M) == 0
    expect_fail(PARAM, vmm.rt.mem_get_address_range, p)
    expect_fail(PARAM, vmm.rt.unmap_mem, p)
    vmm.map(p, G2M, h)  # the reservation is usable again, and the allocation kept its bytes
    assert read(p, 14) == b"survives unmap"


def test_rule_6_release_fails_while_a_mapping_is_inside(vmm):
    h = vmm.alloc()
    base = vmm.reserve(8 * MiB)
    vmm.map(base + 4 * MiB, G2M, h)
    msg = expect_fail(PARAM, vmm.rt.release_mem_address, base)
    assert "unmap" in msg
    assert perms_at(base + 4 * MiB) == "rw-s", "a refused release must leave the mapping alone"
    write(base + 4 * MiB, b"ok")
    vmm.unmap(base + 4 * MiB)
    vmm.release(base)
    assert perms_at(base) is None


def test_rule_6_free_while_mapped_keeps_memory_until_last_unmap(vmm):
    fds0 = set(memfds())
    free0 = vmm.rt.get_mem_info(0)[0]
    h = vmm.alloc()
    p1 = vmm.reserve()
    p2 = vmm.reserve()
    vmm.map(p1, G2M, h)
    vmm.map(p2, G2M, h)
    write(p1, b"still here")
    vmm.free(h)
    for fn, args in ((vmm.rt.free_physical, (h,)), (vmm.rt.mem_get_allocation_properties_from_handle, (h,))):
        expect_fail(BAD_HANDLE, fn, *args)
    p3 = vmm.reserve()
    expect_fail(BAD_HANDLE, vmm.rt.map_mem, p3, G2M, 0, h, 0)
    assert read(p2, 10) == b"still here"
    write(p2, b"and written")
    assert len(set(memfds()) - fds0) == 1, "the memory lives while mapped"
    assert vmm.rt.get_mem_info(0)[0] == free0 - G2M, "mapped memory still counts against the device"
    vmm.unmap(p1)
    assert read(p2, 11) == b"and written"
    assert len(set(memfds()) - fds0) == 1
    vmm.unmap(p2)
    assert set(memfds()) == fds0, "the last unmap frees the memory"
    assert vmm.rt.get_mem_info(0)[0] == free0


# ---------------------------------------------------------------- rule 7: aliasing


def test_rule_7_two_mappings_of_one_allocation_see_the_same_bytes(vmm):
    h = vmm.alloc(4 * MiB)
    a = vmm.reserve(4 * MiB)
    big = vmm.reserve(8 * MiB)
    vmm.map(a, 4 * MiB, h)
    vmm.map(big + 4 * MiB, 4 * MiB, h)
    b = big + 4 * MiB
    write(a + 3 * MiB, b"via A")
    assert read(b + 3 * MiB, 5) == b"via A"
    ok(vmm.rt.memset(b, 4 * MiB, 0x5A, 4 * MiB))
    assert read(a, 4 * MiB) == b"\x5a" * (4 * MiB)
    ok(vmm.rt.mem_set_access(b, 4 * MiB, [desc(READ)]))  # access is per mapping
    write(a, b"A still writes")
    assert read(b, 14) == b"A still writes"


def test_rule_7_aliasing_survives_free_physical(vmm):
    h = vmm.alloc()
    a, b = vmm.reserve(), vmm.reserve()
    vmm.map(a, G2M, h)
    vmm.map(b, G2M, h)
    vmm.free(h)
    write(b + G2M - 3, b"end")
    assert read(a + G2M - 3, 3) == b"end"


def test_rule_7_distinct_allocations_do_not_alias(vmm):
    p1, _ = vmm.mapped()
    p2, _ = vmm.mapped()
    write(p1, b"one")
    assert read(p2, 3) == bytes(3)


def _segments(vmm, sizes, reserve=None, gaps=(), **prop_kw):
    """Allocations of `sizes` mapped back to back from the start of one reservation (a torch_npu expandable
    segment); the indexes in `gaps` are left unmapped. Returns (base, [ptr of each])."""
    total = sum(sizes)
    base = vmm.reserve(reserve or total)
    ptrs, at = [], base
    for k, size in enumerate(sizes):
        if k not in gaps:
            vmm.map(at, size, vmm.alloc(size, **prop_kw))
        ptrs.append(at)
        at += size
    return base, ptrs


def test_rule_7_copies_and_fills_run_across_mappings_end_to_end(vmm):
    """Three allocations back to back are one range for memcpy (each way), memset and their async forms."""
    base, ptrs = _segments(vmm, [G2M, 2 * G2M, G2M])
    total = 4 * G2M
    payload = os.urandom(total)
    src = ctypes.create_string_buffer(payload, total)
    ok(vmm.rt.memcpy(base, total, ctypes.addressof(src), total, 1))  # HOST_TO_DEVICE, over three mappings
    for p, size in zip(ptrs, [G2M, 2 * G2M, G2M], strict=True):
        off = p - base
        assert read(p, size) == payload[off:off + size]
    out = ctypes.create_string_buffer(total)
    ok(vmm.rt.memcpy(ctypes.addressof(out), total, base + 1, total - 1, 2))
    assert out.raw[:total - 1] == payload[1:]
    a, n = ptrs[1] - 100, G2M + 200  # a tensor over two boundaries' neighbourhood
    ok(vmm.rt.memset(a, n, 0xC3, n))
    off = a - base
    assert read(a - 1, n + 2) == payload[off - 1:off] + b"\xc3" * n + payload[off + n:off + n + 1]
    ok(vmm.rt.memcpy(ptrs[2] - 64, 128, ptrs[0] + G2M - 64, 128, 3))  # DEVICE_TO_DEVICE, each side over a boundary
    assert read(ptrs[2] - 64, 128) == read(ptrs[0] + G2M - 64, 128)
    s = vmm.stream()
    ok(vmm.rt.memset_async(ptrs[2] - 10, 20, 0x77, 20, s))
    ok(vmm.rt.memcpy_async(ctypes.addressof(out), 40, ptrs[2] - 20, 40, 2, s))
    ok(vmm.rt.synchronize_stream(s))
    assert out.raw[:40] == read(ptrs[2] - 20, 10) + b"\x77" * 20 + read(ptrs[2] + 10, 10)


def test_rule_7_an_overlapping_copy_across_mappings_moves_like_memmove(vmm):
    _, ptrs = _segments(vmm, [G2M, G2M])
    pattern = bytes(range(256)) * 16
    write(ptrs[1] - 2048, pattern)
    ok(vmm.rt.memcpy(ptrs[1] - 1024, 4096, ptrs[1] - 2048, 4096, 3))  # up, across the boundary
    assert read(ptrs[1] - 1024, 4096) == pattern
    write(ptrs[1] - 2048, pattern)
    ok(vmm.rt.memcpy(ptrs[1] - 3072, 4096, ptrs[1] - 2048, 4096, 3))  # down
    assert read(ptrs[1] - 3072, 4096) == pattern


def test_rule_7_host_memory_next_to_device_memory_is_one_range(vmm):
    host_next = vmm.reserve(2 * G2M)
    vmm.map(host_next, G2M, vmm.alloc(loc_type=HOST))
    vmm.map(host_next + G2M, G2M, vmm.alloc())
    data = os.urandom(8192)
    buf = ctypes.create_string_buffer(data, 8192)
    ok(vmm.rt.memcpy(host_next + G2M - 4096, 8192, ctypes.addressof(buf), 8192, 4))  # DEFAULT: the runtime decides
    assert read(host_next + G2M - 4096, 8192) == data
    msg = expect_fail(PARAM, vmm.rt.memcpy, host_next + G2M - 4096, 8192, ctypes.addressof(buf), 8192, 1)
    assert "kind" in msg and "host and device" in msg  # HOST_TO_DEVICE into a range that is half host memory


def test_rule_7_a_copy_into_an_unmapped_gap_fails_and_writes_nothing(vmm):
    """107000 only when some byte is unmapped, and the message names the first such address; the mapped part
    before the gap is left as it was (every side is checked before any byte moves)."""
    base, ptrs = _segments(vmm, [G2M, G2M, G2M], gaps=(1,))
    write(ptrs[0], b"\x11" * 4096)
    src = ctypes.create_string_buffer(os.urandom(3 * G2M), 3 * G2M)
    before = read(ptrs[0] + G2M - 4096, 4096)
    for fn, args in ((vmm.rt.memcpy, (ptrs[0] + G2M - 4096, 8192, ctypes.addressof(src), 8192, 4)),
                     (vmm.rt.memset, (ptrs[0] + G2M - 4096, 8192, 0xEE, 8192)),
                     (vmm.rt.memcpy_async, (ptrs[0] + G2M - 4096, 8192, ctypes.addressof(src), 8192, 4, 0)),
                     (vmm.rt.memset_async, (ptrs[0] + G2M - 4096, 8192, 0xEE, 8192, 0))):
        msg = expect_fail(PARAM, fn, *args)
        assert f"{ptrs[1]:#x}" in msg and "reserved but not mapped" in msg, msg
    ok(vmm.rt.synchronize_stream(0))
    assert read(ptrs[0] + G2M - 4096, 4096) == before
    out = ctypes.create_string_buffer(3 * G2M)
    msg = expect_fail(PARAM, vmm.rt.memcpy, ctypes.addressof(out), 3 * G2M, base, 3 * G2M, 2)
    assert f"{ptrs[1]:#x}" in msg
    lone = vmm.reserve(2 * G2M)  # a range that runs out of the reservation's one mapping
    vmm.map(lone, G2M, vmm.alloc())
    assert f"{lone + G2M:#x}" in expect_fail(PARAM, vmm.rt.memset, lone + G2M - 8, 16, 0, 16)


@pytest.mark.parametrize("acl", ["python"], indirect=True)  # acl.util is pyACL's own module, not a C call
def test_rule_7_cpu_views_run_across_mappings_end_to_end(vmm):
    """acl.util's views check the range as the copies do: across host mappings end to end they work; into a gap
    they refuse (None, a message naming the address)."""
    import vmmshare.acl as acl

    _, ptrs = _segments(vmm, [G2M, G2M, G2M], gaps=(2,))
    write(ptrs[1] - 4, b"abcdefgh")
    assert acl.util.ptr_to_bytes(ptrs[1] - 4, 8) == b"abcdefgh"
    assert acl.util.ptr_to_bytes(ptrs[2] - 4, 8) is None
    assert f"{ptrs[2]:#x}" in acl.get_recent_err_msg()


def test_rule_7_a_read_only_mapping_in_the_range_refuses_the_whole_write(vmm):
    _, ptrs = _segments(vmm, [G2M, G2M])
    ok(vmm.rt.mem_set_access(ptrs[1], G2M, [desc(READ)]))
    before = read(ptrs[0] + G2M - 16, 32)
    src = ctypes.create_string_buffer(b"\x01" * 32, 32)
    msg = expect_fail(PARAM, vmm.rt.memcpy, ptrs[0] + G2M - 16, 32, ctypes.addressof(src), 32, 4)
    assert f"{ptrs[1]:#x}" in msg and "writable" in msg
    assert read(ptrs[0] + G2M - 16, 32) == before
    out = ctypes.create_string_buffer(32)
    ok(vmm.rt.memcpy(ctypes.addressof(out), 32, ptrs[0] + G2M - 16, 32, 2))  # reading it is fine
    assert out.raw == before


# ---------------------------------------------------------------- rule 8: retain, address range


def test_rule_8_retain_returns_the_handle_and_adds_a_reference(vmm):
    h = vmm.alloc(4 * MiB)
    base = vmm.reserve(8 * MiB)
    vmm.map(base + 2 * MiB, 4 * MiB, h)
    for addr in (base + 2 * MiB, base + 2 * MiB + 1, base + 6 * MiB - 1):
        assert ok(vmm.rt.mem_retain_allocation_handle(addr)) == h
    for _ in range(3):  # three retains: three more frees needed
        ok(vmm.rt.free_physical(h))
        assert ok(vmm.rt.mem_get_allocation_properties_from_handle(h)) == prop()
    vmm.free(h)
    expect_fail(BAD_HANDLE, vmm.rt.free_physical, h)
    expect_fail(BAD_HANDLE, vmm.rt.mem_get_allocation_properties_from_handle, h)


def test_rule_8_retain_after_free_gives_a_working_handle(vmm):
    p, h = vmm.mapped()
    vmm.free(h)
    expect_fail(BAD_HANDLE, vmm.rt.mem_get_allocation_properties_from_handle, h)
    got = ok(vmm.rt.mem_retain_allocation_handle(p))
    assert got == h
    assert ok(vmm.rt.mem_get_allocation_properties_from_handle(got)) == prop()
    vmm.handles.append(got)


def test_rule_8_retain_outside_a_mapping_fails(vmm):
    base = vmm.reserve(4 * MiB)
    h = vmm.alloc()
    vmm.map(base, G2M, h)
    for addr in (base + G2M, base + 4 * MiB, base - 1):
        expect_fail(PARAM, vmm.rt.mem_retain_allocation_handle, addr)
    expect_fail(ACL_PARAM, vmm.rt.mem_retain_allocation_handle, 0)  # NULL: the acl layer's check


def test_rule_8_address_range_for_any_address_inside(vmm):
    h = vmm.alloc(4 * MiB)
    base = vmm.reserve(8 * MiB)
    p = base + 2 * MiB
    vmm.map(p, 4 * MiB, h)
    for addr in (p, p + 1, p + 4095, p + 3 * MiB, p + 4 * MiB - 1):
        assert vmm.rt.mem_get_address_range(addr) == (p, 4 * MiB, 0)
    for addr in (base, p - 1, p + 4 * MiB, base + 8 * MiB):
        expect_fail(PARAM, vmm.rt.mem_get_address_range, addr)
    expect_fail(ACL_PARAM, vmm.rt.mem_get_address_range, 0)  # NULL: the acl layer's check


def test_rule_8_properties_round_trip(vmm):
    """The runtime reports the page and memory type an attribute stands for (tests/test_acl_layer.py has its whole
    table): these attributes come back as given."""
    for kw in ({"attr": 5}, {"attr": 16, "dev": 1}, {"attr": 7, "loc_type": HOST}, {"attr": 4, "loc_type": HOST}):
        h = vmm.alloc(G2M, **kw)
        assert ok(vmm.rt.mem_get_allocation_properties_from_handle(h)) == prop(**kw)


@pytest.mark.parametrize("loc_type", [2, 3])
def test_rule_1_unsupported_location_types_are_207000(acl, loc_type):
    """UNREGISTERED and MANAGED: the granularity query passes them to the runtime, which does not support them
    (207000); malloc_physical refuses them in the acl layer (100000). HOST_NUMA (4) is supported."""
    expect_fail(NOT_SUPPORTED, acl.rt.mem_get_allocation_granularity, prop(loc_type=loc_type), 0)
    expect_fail(ACL_PARAM, acl.rt.malloc_physical, G2M, prop(loc_type=loc_type), 0)


def test_rule_1_device_id_out_of_range_is_107001(acl):
    n = ok(acl.rt.get_device_count())
    for dev in (n, -1, 1 << 20):
        expect_fail(BAD_DEVICE, acl.rt.malloc_physical, G2M, prop(dev=dev, loc_type=DEVICE), 0)


def test_rule_2_host_and_device_location_allocations_are_memfds(vmm, acl):
    acl.rt.get_mem_info(0)  # the broker's connection, made by a process's first call, is not an allocation's fd
    before = fd_count()
    vmm.alloc(loc_type=HOST)
    vmm.alloc(dev=1)
    assert fd_count() == before + 2
