"""The Pythonic API: objects that own what they wrap, exceptions with ACL codes, zero-copy views."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import vmmshare
from conftest import SIGSEGV_RC, run_child
from vmmshare import constants as C
from vmmshare._process import runtime
from vmmshare.wire.props import Location

MiB = 1 << 20


def counts() -> dict[str, int]:
    return runtime().counts()


def child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=60)


def test_allocate_rounds_up_and_closes_deterministically() -> None:
    before = counts()
    mem = vmmshare.Device(0).allocate(3 * MiB)
    assert mem.size == 4 * MiB and not mem.imported and mem.device == 0
    assert counts()["allocations"] == before["allocations"] + 1
    mem.close()
    mem.close()  # idempotent
    assert mem.closed and counts() == before


def test_objects_close_on_garbage_collection() -> None:
    before = counts()
    mem = vmmshare.Device(1).allocate(2 * MiB)
    mapping = mem.map()
    view = mapping.numpy()
    view[:] = 7
    del view, mapping, mem
    gc.collect()
    assert counts() == before


def test_errors_are_acl_errors_with_codes() -> None:
    with pytest.raises(vmmshare.InvalidDeviceError) as info:
        vmmshare.Device(10_000)
    assert info.value.code == C.ACL_ERROR_RT_INVALID_DEVICEID
    with pytest.raises(vmmshare.InvalidParamError):
        vmmshare.Device(0).allocate(0)
    with pytest.raises(vmmshare.InvalidHandleError) as bad:
        vmmshare.import_handle(0x1234_5678_9ABC_DEF0)
    assert bad.value.code == C.ACL_ERROR_RT_INVALID_HANDLE
    assert "unknown" in bad.value.message
    with vmmshare.Device(0).allocate(2 * MiB) as mem:
        mem.export()
        with pytest.raises(vmmshare.InvalidParamError):
            mem.export()  # a handle exports once


def test_mapping_refuses_to_close_under_live_views() -> None:
    with vmmshare.Device(0).allocate(2 * MiB) as mem:
        mapping = mem.map()
        view = mapping.memoryview()
        with pytest.raises(BufferError):
            mapping.close()
        view.release()
        del view
        gc.collect()
        mapping.close()
        assert mapping.closed


def test_a_mapping_unmapped_through_acl_still_gives_its_range_back() -> None:
    """map() reserves and maps in one step; unmap_mem of its pointer leaves the range, which close() releases."""
    from vmmshare import acl

    before = counts()
    mem = vmmshare.Device(0).allocate(2 * MiB)
    mapping = mem.map()
    assert acl.rt.unmap_mem(mapping.ptr) == 0
    mapping.close()
    mem.close()
    assert counts() == before


def test_map_is_refused_past_the_address_arena_as_reserve_is() -> None:
    """A host allocation larger than the arena (sparse: it commits nothing) maps nowhere, with reserve's code."""
    from vmmshare import acl
    from vmmshare.backends import mman

    size = mman.ARENA_END - mman.ARENA_START + 2 * MiB
    mem = vmmshare.Device(0).allocate(size, location="host")
    try:
        assert acl.rt.reserve_mem_address(size, 0, 0, 0)[1] == C.ACL_ERROR_RT_PARAM_INVALID
        with pytest.raises(vmmshare.AclError) as err:
            mem.map(access="none")
        assert err.value.code == C.ACL_ERROR_RT_PARAM_INVALID and "more than one reservation holds" in str(err.value)
    finally:
        mem.close()


def test_numpy_view_is_zero_copy_and_two_mappings_share_bytes() -> None:
    with vmmshare.Device(0).allocate(2 * MiB) as mem, mem.map() as first, mem.map() as second:
        a = first.numpy(np.float32, (512, 1024))
        b = second.numpy(np.float32, (512, 1024))
        a[3, 4] = 42.0
        assert b[3, 4] == 42.0
        assert a.ctypes.data == first.ptr
        del a, b


def test_dlpack_with_numpy() -> None:
    with vmmshare.Device(0).allocate(2 * MiB) as mem, mem.map() as mapping:
        assert mapping.__dlpack_device__() == (1, 0)
        arr = np.from_dlpack(mapping)
        arr[:4] = [1, 2, 3, 4]
        assert bytes(mapping.memoryview()[:4]) == b"\x01\x02\x03\x04"
        del arr
        gc.collect()


def test_dlpack_with_torch() -> None:
    torch = pytest.importorskip("torch")
    with vmmshare.Device(0).allocate(2 * MiB) as mem, mem.map() as mapping:
        t = torch.from_dlpack(mapping)
        t[:3] = torch.tensor([9, 8, 7], dtype=torch.uint8)
        assert bytes(mapping.memoryview()[:3]) == b"\x09\x08\x07"
        assert t.data_ptr() == mapping.ptr
        del t
        gc.collect()


READ_ONLY_CHILD = """
import vmmshare
with vmmshare.Device(0).allocate(2 << 20) as mem, mem.map() as rw, mem.map(access="r") as ro:
    rw.memoryview()[:5] = b"hello"
    assert bytes(ro.memoryview()[:5]) == b"hello", "a read through the read-only mapping"
    print("READ", flush=True)
    ro.memoryview()[4096] = 1  # must fault: the mapping is read-only
    print("SURVIVED", flush=True)
"""


def test_read_only_access() -> None:
    with vmmshare.Device(0).allocate(2 * MiB) as mem, mem.map(access="r") as mapping:
        assert runtime().memory.get_access(mapping.ptr, Location(1, 0)) == C.ACL_RT_MEM_ACCESS_FLAGS_READ
        mapping.set_access("rw")
        mapping.memoryview()[0] = 1
        assert bytes(mapping.memoryview()[:1]) == b"\x01"
    # a write through a read-only mapping dies of SIGSEGV (in a child); a read through it succeeds
    proc = run_child(READ_ONLY_CHILD)
    assert "READ" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.returncode == SIGSEGV_RC and "SURVIVED" not in proc.stdout, (proc.returncode, proc.stdout,
                                                                            proc.stderr)


def test_shareable_handle_value_object() -> None:
    with vmmshare.Device(0).allocate(2 * MiB) as mem:
        h = mem.export(validate_pids=False)
    assert h.kind == "default"
    assert str(h).startswith("vmm:default:") and len(str(h)) == len("vmm:default:") + 16
    assert vmmshare.ShareableHandle.parse(str(h)) == h
    assert pickle.loads(pickle.dumps(h)) == h
    assert vmmshare.ShareableHandle.from_value(int(h)) == h
    assert int(str(h).split(":")[2], 16) == int(h)
    for bad in ("vmm:default:xyz", "vmm:other:00", "", "vmm:default:" + "0" * 15, "vmm:default:" + "0" * 16,
                123, None):
        with pytest.raises(vmmshare.InvalidParamError):
            vmmshare.ShareableHandle.parse(bad)  # type: ignore[arg-type]
    with pytest.raises(vmmshare.InvalidParamError):
        vmmshare.ShareableHandle("default", "abcdefgh")  # type: ignore[arg-type]


def test_fabric_handle_value_object() -> None:
    with vmmshare.Device(2).allocate(2 * MiB) as mem:
        h = mem.export(share_type="fabric")
        assert h.kind == "fabric" and len(bytes(h)) == 128 and bytes(h)[:4] == b"VMMF"
        assert vmmshare.ShareableHandle.parse(str(h)) == h
        with pytest.raises(TypeError):
            int(h)


@pytest.mark.parametrize("share_type", ["default", "fabric"])
def test_share_with_another_process(share_type: str) -> None:
    code = """
        import sys, numpy as np, vmmshare
        pid = vmmshare.acl.rt.device_get_bare_tgid()[0]
        print(pid, flush=True)
        sys.stdin.readline()
        with vmmshare.import_handle(sys.argv[1]) as mem, mem.map() as m:
            a = m.numpy(np.int64)
            print(int(a.sum()), flush=True)
            a[:] = 1
            del a
    """
    with vmmshare.Device(0).allocate(2 * MiB) as mem, mem.map() as mapping:
        a = mapping.numpy(np.int64)
        a[:] = np.arange(a.size)
        h = mem.export(share_type=share_type)
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(h)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdin is not None
        mem.allow([int(p.stdout.readline())])
        out, err = p.communicate("go\n", timeout=60)
        assert p.returncode == 0, err
        assert int(out) == int(np.arange(a.size).sum())
        assert (a == 1).all()
        del a


def test_refused_import_raises_no_permission() -> None:
    with vmmshare.Device(0).allocate(2 * MiB) as mem:
        h = mem.export()
        out = child("""
            import sys, vmmshare
            try:
                vmmshare.import_handle(sys.argv[1])
            except vmmshare.NoPermissionError as exc:
                print(exc.code)
        """, str(h))
    assert out.stdout.strip() == "207006", out.stderr


def test_virtual_range_at_a_chosen_address() -> None:
    with vmmshare.VirtualRange(4 * MiB) as rng:
        at = rng.ptr
    with vmmshare.VirtualRange(4 * MiB, at=at) as again:
        assert again.ptr == at
        with pytest.raises(vmmshare.InvalidParamError):
            vmmshare.VirtualRange(2 * MiB, at=at)  # taken
        with vmmshare.Device(0).allocate(2 * MiB) as mem:
            m = again.map(mem, offset=2 * MiB)
            assert m.ptr == at + 2 * MiB
            m.close()


@pytest.mark.parametrize("offset", [-2 * MiB, 4 * MiB, 3 * MiB, "x", None])
def test_virtual_range_maps_only_inside_itself(offset: object) -> None:
    """An offset that would put the memory outside the range (before it, past it, straddling its end) or that is
    not an int is refused with 107000, and nothing is mapped: a neighbouring range stays untouched."""
    before = counts()
    with vmmshare.VirtualRange(4 * MiB) as lo, vmmshare.VirtualRange(4 * MiB) as hi, \
            vmmshare.Device(0).allocate(2 * MiB) as mem:
        with pytest.raises(vmmshare.InvalidParamError) as err:
            hi.map(mem, offset=offset)  # type: ignore[arg-type]
        assert err.value.code == C.ACL_ERROR_RT_PARAM_INVALID
        with pytest.raises(vmmshare.InvalidParamError):
            hi.map(object())  # type: ignore[arg-type]
        assert counts()["mappings"] == before["mappings"]
        lo.map(mem).close()  # the neighbour is free for its own mapping
    assert counts() == before


@pytest.mark.parametrize("location, device", [("host", 0), ("device", 1)])
def test_set_access_after_the_memory_is_closed(location: str, device: int) -> None:
    """A mapping outlives its PhysicalMemory's close(); its access can still be changed, for its own location."""
    out = child(f"""
        import vmmshare
        mem = vmmshare.Device({device}).allocate(2 << 20, location={location!r})
        m = mem.map()
        m.set_access("r")
        mem.close()
        m.set_access("rw")
        view = m.memoryview()
        view[0] = 7
        assert view[0] == 7
        del view
        m.close()
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_device_mem_info_is_what_get_mem_info_says() -> None:
    import vmmshare.acl as acl

    assert acl.rt.set_device(0) == 0
    try:
        with vmmshare.Device(0).allocate(2 * MiB):
            free, total, ret = acl.rt.get_mem_info(0)
            assert ret == 0 and vmmshare.Device(0).mem_info() == (free, total)
    finally:
        assert acl.rt.reset_device(0) == 0


def test_dlpack_capsules_are_released_and_hold_the_mapping() -> None:
    from vmmshare.api import dlpack

    with vmmshare.Device(0).allocate(2 * MiB) as mem:
        mapping = mem.map()
        unconsumed = mapping.__dlpack__(max_version=(1, 0))
        legacy = mapping.__dlpack__()
        assert dlpack.live_count() == 2
        del unconsumed, legacy
        gc.collect()
        assert dlpack.live_count() == 0
        arr = np.from_dlpack(mapping)
        assert arr.flags.writeable and arr.ctypes.data == mapping.ptr
        with pytest.raises(BufferError):
            mapping.close()  # a consumer still holds the memory
        del arr
        gc.collect()
        assert dlpack.live_count() == 0
        with pytest.raises(BufferError):
            mapping.__dlpack__(copy=True)
        with pytest.raises(BufferError):
            mapping.__dlpack__(dl_device=(2, 0))
        mapping.close()


def test_dlpack_legacy_capsule_with_torch() -> None:
    torch = pytest.importorskip("torch")
    from vmmshare.api import dlpack

    with vmmshare.Device(0).allocate(2 * MiB) as mem, mem.map() as mapping:
        t = torch.utils.dlpack.from_dlpack(mapping.__dlpack__())  # the unversioned protocol
        t[:2] = 3
        assert bytes(mapping.memoryview()[:2]) == b"\x03\x03"
        del t
        gc.collect()
        assert dlpack.live_count() == 0


def test_a_finalizer_inside_a_broker_request_waits_instead_of_deadlocking() -> None:
    """The garbage collector can run a finalizer at any allocation, also while this thread is in the middle of a
    broker request; freeing then must not start a nested request (it would deadlock on the connection's lock, or
    read the outer request's reply). It is deferred to the next call that talks to the broker."""
    code = """
        import vmmshare
        from vmmshare._process import runtime
        from vmmshare.wire import local as P
        rt = runtime()
        holder = [vmmshare.Device(0).allocate(2 << 20)]
        before = rt.counts()["allocations"]
        rt.node.request(P.BareTgid(), P.Pid, meanwhile=holder.clear)  # finalizer runs in there
        deferred = rt.counts()["allocations"]
        vmmshare.Device(0).allocate(2 << 20).close()
        print(before, deferred, rt.counts()["allocations"])
    """
    out = child(code)
    assert out.returncode == 0, out.stderr
    before, deferred, after = map(int, out.stdout.split())
    assert (before, deferred, after) == (1, 1, 0)
