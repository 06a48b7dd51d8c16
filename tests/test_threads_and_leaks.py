"""No leaks (fds, VMAs, runtime tables) over many cycles, failure paths included; and concurrent threads."""

from __future__ import annotations

import gc
import struct
import threading

from conftest import (
    ARENA_END,
    ARENA_START,
    BAD_HANDLE,
    G2M,
    NO_MEMORY,
    PARAM,
    READ,
    READWRITE,
    MiB,
    child_ok,
    desc,
    fd_count,
    map_count,
    memfds,
    ok,
    private_broker_env,
    read,
    ret_of,
    vmas,
    write,
)
from vmmshare._process import runtime


def _cycle(rt) -> None:
    """One round of everything, with the failure paths in between; leaves nothing behind."""
    h = ok(rt.malloc_physical(4 * MiB, {"handleType": 0, "allocationType": 0, "memAttr": 5,
                                        "location": {"id": 0, "type": 1}, "reserve": 0}, 0))
    base = ok(rt.reserve_mem_address(8 * MiB, 0, 0, 0))
    ok(rt.map_mem(base, 4 * MiB, 0, h, 0))
    write(base + MiB, b"cycle")
    # failure paths, each must leave nothing behind
    assert rt.map_mem(base + G2M, 4 * MiB, 0, h, 0) == PARAM           # overlap
    assert rt.map_mem(base + 4 * MiB, G2M, 0, h, 0) == PARAM           # wrong size
    assert rt.release_mem_address(base) == PARAM                        # still mapped
    assert rt.reserve_mem_address(G2M, 0, base, 0) == (0, PARAM)        # expect_ptr in use
    assert rt.reserve_mem_address(G2M, G2M, 0, 0) == (0, PARAM)         # alignment
    assert ret_of(rt.malloc_physical(G2M + 1, {"handleType": 0, "allocationType": 0, "memAttr": 5,
                                               "location": {"id": 0, "type": 1}, "reserve": 0}, 0)) == PARAM
    assert ret_of(rt.malloc_physical(G2M, {"handleType": 0}, 0)) == PARAM
    assert rt.mem_set_access(base, G2M, [desc(READ)]) == PARAM          # not the mapped range
    assert rt.memcpy(base + 4 * MiB, 16, base, 16, 4) == PARAM         # reserved, not mapped
    assert rt.free_physical(h + 1) == BAD_HANDLE
    # a second mapping of the same allocation, no-access then read/write
    ok(rt.mem_map_no_access(base + 4 * MiB, 4 * MiB, 0, h, 0))
    ok(rt.mem_set_access(base + 4 * MiB, 4 * MiB, [desc(READWRITE)]))
    assert read(base + 5 * MiB, 5) == b"cycle"
    h2 = ok(rt.mem_retain_allocation_handle(base + 4 * MiB))
    assert h2 == h
    ok(rt.free_physical(h))
    ok(rt.free_physical(h))                                             # free while mapped
    assert rt.free_physical(h) == BAD_HANDLE
    ok(rt.unmap_mem(base))
    ok(rt.unmap_mem(base + 4 * MiB))
    ok(rt.release_mem_address(base))
    hp = ok(rt.malloc_host(3 * 4096))
    ok(rt.memcpy(hp, 4096, hp + 4096, 4096, 0))
    ok(rt.free_host(hp))
    assert rt.free_host(hp) == PARAM
    s = ok(rt.create_stream())
    ok(rt.synchronize_stream(s))
    ok(rt.destroy_stream(s))
    assert rt.destroy_stream(s) == 107017  # destroyed: an unknown handle


def _arena_vmas() -> int:
    return len(vmas(ARENA_START, ARENA_END))


def test_fds_vmas_and_tables_return_to_baseline(acl):
    for _ in range(3):  # warm up: broker connection, caches, interpreter arenas
        _cycle(acl.rt)
    gc.collect()
    fds, maps, arena, mfds, counts = fd_count(), map_count(), _arena_vmas(), set(memfds()), runtime().counts()
    for _ in range(200):
        _cycle(acl.rt)
    gc.collect()
    assert set(memfds()) == mfds, "memfds leaked"
    assert fd_count() == fds, "file descriptors leaked"
    assert _arena_vmas() == arena, "reservations or mappings leaked in the arena"
    assert map_count() == maps, "VMAs leaked"
    assert runtime().counts() == counts


def test_over_capacity_failures_leak_nothing_in_a_child(tmp_path):
    child_ok(
        """
        import gc
        def fds(): return len(os.listdir("/proc/self/fd"))
        def maps(): return sum(1 for _ in open("/proc/self/maps"))
        assert acl.rt.set_device(0) == 0
        keep = ok(acl.rt.malloc_physical(6 * M, P(0), 0))
        p = ok(acl.rt.reserve_mem_address(8 * M, 0, 0, 0))
        ok(acl.rt.map_mem(p, 6 * M, 0, keep, 0))
        assert acl.rt.malloc_physical(4 * M, P(0), 0) == (0, 207001)
        gc.collect()
        base = (fds(), maps(), runtime().counts(), acl.rt.get_mem_info(0))
        for i in range(300):
            assert acl.rt.malloc_physical(4 * M, P(0), 0) == (0, 207001), i
            assert acl.rt.malloc_physical((1 << 40) + 2 * M * i, P(0), 0) == (0, 207001), i
            h = ok(acl.rt.malloc_physical(2 * M, P(0), 0))   # fills the device exactly
            assert acl.rt.malloc_physical(2 * M, P(0), 0) == (0, 207001), i
            ok(acl.rt.free_physical(h))
        gc.collect()
        assert (fds(), maps(), runtime().counts(), acl.rt.get_mem_info(0)) == base
        ok(acl.rt.unmap_mem(p)); ok(acl.rt.release_mem_address(p)); ok(acl.rt.free_physical(keep))
        assert acl.rt.get_mem_info(0) == (8 * M, 8 * M, 0)
        """,
        private_broker_env(tmp_path, VMMSHARE_DEVICE_MEMORY="8M"),
    )
    assert NO_MEMORY == 207001


THREADS = 8
ITERATIONS = 200
PROBES = (0, MiB - 2048, G2M - 4096)  # where each iteration writes and checks its pattern


def _pattern(tid: int, it: int) -> bytes:
    return struct.pack("<QQ", tid, it) * 256  # 4 KiB unique to (thread, iteration)


def _worker(acl, tid: int, start: threading.Barrier, errors: list[str], done: list[int]) -> None:
    rt = acl.rt
    prop = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": tid % 2, "type": 1}, "reserve": 0}
    try:
        if rt.set_device(tid % 2) != 0:
            errors.append(f"{tid}: set_device failed")
            return
        start.wait()
        for it in range(ITERATIONS):
            h, ret = rt.malloc_physical(G2M, prop, 0)
            p, ret2 = rt.reserve_mem_address(G2M, 0, 0, 0)
            if ret or ret2:
                errors.append(f"{tid}/{it}: malloc {ret} reserve {ret2}: {acl.get_recent_err_msg()}")
                return
            if rt.map_mem(p, G2M, 0, h, 0) != 0:
                errors.append(f"{tid}/{it}: map failed: {acl.get_recent_err_msg()}")
                return
            for off in PROBES:
                if read(p + off, 4096) != bytes(4096):
                    errors.append(f"{tid}/{it}: fresh memory at +{off:#x} is not zero: {read(p + off, 16)!r}")
            pat = _pattern(tid, it)
            for off in PROBES:
                write(p + off, pat)
            # a failure of this thread names this thread's pointer, whatever the other threads do meanwhile
            if rt.reserve_mem_address(G2M, 0, p, 0) != (0, PARAM) or f"{p:x}" not in acl.get_recent_err_msg():
                errors.append(f"{tid}/{it}: recent message is not this thread's: {acl.get_recent_err_msg()!r}")
            if rt.mem_get_address_range(p + 12345) != (p, G2M, 0):
                errors.append(f"{tid}/{it}: address range of own mapping is wrong")
            for off in PROBES:
                got = read(p + off, 4096)
                if got != pat:
                    errors.append(f"{tid}/{it}: data at +{off:#x} crossed: {struct.unpack('<QQ', got[:16])}")
            for what, ret in (("unmap", rt.unmap_mem(p)), ("release", rt.release_mem_address(p)),
                              ("free", rt.free_physical(h))):
                if ret != 0:
                    errors.append(f"{tid}/{it}: {what} failed {ret}: {acl.get_recent_err_msg()}")
            done[tid] += 1
    except Exception as exc:  # reported below; a worker must not die silently
        errors.append(f"{tid}: raised {exc!r}")
    finally:
        rt.reset_device(tid % 2)


def test_threads_concurrent_cycles_keep_tables_consistent(acl):
    _cycle(acl.rt)  # warm up
    gc.collect()
    fds, mfds, arena, counts = fd_count(), set(memfds()), _arena_vmas(), runtime().counts()
    start = threading.Barrier(THREADS)
    errors: list[str] = []
    done = [0] * THREADS
    threads = [threading.Thread(target=_worker, args=(acl, t, start, errors, done)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert done == [ITERATIONS] * THREADS
    assert runtime().counts() == counts
    assert fd_count() == fds and set(memfds()) == mfds
    assert _arena_vmas() == arena
    free0, total, _ = acl.rt.get_mem_info(0)
    ok(acl.rt.set_device(1))
    assert acl.rt.get_mem_info(0)[:2] == (total, total), "device 1 capacity came back"
    ok(acl.rt.reset_device(1))
    assert free0 == total


def test_threads_sharing_one_allocation_see_each_others_writes(vmm):
    """Threads map one allocation each in their own reservation and write disjoint slots; all see all slots."""
    h = vmm.alloc(G2M)
    start, done = threading.Barrier(THREADS), threading.Barrier(THREADS)
    seen: dict[int, bytes] = {}
    errors: list[str] = []

    def worker(tid: int) -> None:
        try:
            p, ret = vmm.rt.reserve_mem_address(G2M, 0, 0, 0)
            assert ret == 0
            assert vmm.rt.map_mem(p, G2M, 0, h, 0) == 0
            start.wait()
            write(p + tid * 4096, _pattern(tid, 0))
            done.wait()
            seen[tid] = read(p, THREADS * 4096)
            assert vmm.rt.unmap_mem(p) == 0
            assert vmm.rt.release_mem_address(p) == 0
        except Exception as exc:
            errors.append(f"{tid}: {exc!r}")
            start.abort()
            done.abort()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    expected = b"".join(_pattern(t, 0) for t in range(THREADS))
    assert seen == dict.fromkeys(range(THREADS), expected)


def test_a_forked_child_starts_empty_and_the_parent_keeps_its_memory() -> None:
    """After fork(), the child has none of the parent's handles, mappings or memfds and a broker connection of its
    own; it allocates and exports by itself; the parent's allocation, mapping and export are untouched."""
    child_ok("""
        import json
        ok(acl.rt.set_device(0))
        h = ok(acl.rt.malloc_physical(2 * M, P(), 0))
        p = ok(acl.rt.reserve_mem_address(2 * M, 0, 0, 0))
        ok(acl.rt.map_mem(p, 2 * M, 0, h, 0))
        ctypes.memset(p, 0x5A, 16)
        sh = ok(acl.rt.mem_export_to_shareable_handle_v2(h, 1, 1))
        def memfds():
            n = 0
            for fd in os.listdir("/proc/self/fd"):
                try:
                    n += "memfd:vmmshare" in os.readlink(f"/proc/self/fd/{fd}")
                except FileNotFoundError:  # the listing's own fd
                    pass
            return n
        assert memfds() == 1
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            c = runtime().counts()
            report = {"counts": c, "memfds": memfds(), "tgid": acl.rt.device_get_bare_tgid()[0]}
            acl.rt.set_device(0)
            h2, ret = acl.rt.malloc_physical(2 * M, P(), 0)
            report["malloc"] = ret
            report["export"] = acl.rt.mem_export_to_shareable_handle_v2(h2, 1, 1)[-1]
            report["free"] = acl.rt.free_physical(h2)
            os.write(w, json.dumps(report).encode())
            os._exit(0)
        os.close(w)
        report = json.loads(os.read(r, 65536))
        assert os.waitpid(pid, 0)[1] == 0
        assert all(v == 0 for v in report["counts"].values()), report
        assert report["memfds"] == 0 and report["tgid"] == pid, report
        assert (report["malloc"], report["export"], report["free"]) == (0, 0, 0), report
        assert ctypes.string_at(p, 16) == b"\\x5a" * 16
        assert runtime().counts()["allocations"] == 1
        ok(acl.rt.unmap_mem(p)); ok(acl.rt.release_mem_address(p)); ok(acl.rt.free_physical(h))
    """)
