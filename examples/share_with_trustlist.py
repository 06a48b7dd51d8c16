"""Physical memory sharing with a PID trustlist, with `vmmshare.acl` (written for vmmshare from the runtime's API
documentation).

The exporter allocates physical memory, maps and fills it, exports it (trustlist on), adds the
importer's pid, and hands the shareable handle over a pipe; the importer maps the same memory and
checks the bytes. Run from the repository root, after ``scripts/setup.sh``:
``.venv/bin/python examples/share_with_trustlist.py``.
"""

import ctypes
import subprocess
import sys

import vmmshare.acl as acl

SIZE = 2 * 1024 * 1024
DEVICE = 0


def check(ret, what):
    if ret != acl.ACL_SUCCESS:
        raise SystemExit(f"{what} failed: {ret} {acl.get_recent_err_msg()}")


def importer():
    check(acl.rt.set_device(DEVICE), "aclrtSetDevice")
    pid, ret = acl.rt.device_get_bare_tgid()
    check(ret, "aclrtDeviceGetBareTgid")
    print(pid, flush=True)  # the exporter puts this pid on the trustlist
    shareable = int(sys.stdin.readline())
    handle, ret = acl.rt.mem_import_from_shareable_handle_v2(shareable, acl.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT, 0)
    check(ret, "aclrtMemImportFromShareableHandleV2")
    ptr, ret = acl.rt.reserve_mem_address(SIZE, 0, 0, 0)
    check(ret, "aclrtReserveMemAddress")
    check(acl.rt.map_mem(ptr, SIZE, 0, handle, 0), "aclrtMapMem")
    data = ctypes.string_at(ptr, 16)
    print(data.hex(), flush=True)
    check(acl.rt.unmap_mem(ptr), "aclrtUnmapMem")
    check(acl.rt.release_mem_address(ptr), "aclrtReleaseMemAddress")
    check(acl.rt.free_physical(handle), "aclrtFreePhysical")
    check(acl.rt.reset_device(DEVICE), "aclrtResetDevice")


def exporter():
    check(acl.init(), "aclInit")
    check(acl.rt.set_device(DEVICE), "aclrtSetDevice")
    prop = {
        "handleType": acl.ACL_MEM_HANDLE_TYPE_NONE,
        "allocationType": acl.ACL_MEM_ALLOCATION_TYPE_PINNED,
        "memAttr": acl.ACL_HBM_MEM_HUGE,
        "location": {"id": DEVICE, "type": acl.ACL_MEM_LOCATION_TYPE_DEVICE},
        "reserve": 0,
    }
    granularity, ret = acl.rt.mem_get_allocation_granularity(prop, acl.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM)
    check(ret, "aclrtMemGetAllocationGranularity")
    assert SIZE % granularity == 0
    handle, ret = acl.rt.malloc_physical(SIZE, prop, 0)
    check(ret, "aclrtMallocPhysical")
    ptr, ret = acl.rt.reserve_mem_address(SIZE, 0, 0, 0)
    check(ret, "aclrtReserveMemAddress")
    check(acl.rt.map_mem(ptr, SIZE, 0, handle, 0), "aclrtMapMem")
    check(acl.rt.memset(ptr, SIZE, 0x5A, SIZE), "aclrtMemset")

    shareable, ret = acl.rt.mem_export_to_shareable_handle_v2(
        handle, acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, acl.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT
    )
    check(ret, "aclrtMemExportToShareableHandleV2")
    child = subprocess.Popen([sys.executable, __file__, "--importer"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    importer_pid = int(child.stdout.readline())
    check(acl.rt.mem_set_pid_to_shareable_handle_v2(shareable, acl.ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT,
                                                    [importer_pid]), "aclrtMemSetPidToShareableHandleV2")
    child.stdin.write(f"{shareable}\n")
    child.stdin.flush()
    seen = child.stdout.readline().strip()
    assert child.wait() == 0, "the importer failed"
    assert seen == "5a" * 16, f"the importer saw {seen}"
    print(f"exported {shareable:#x} to pid {importer_pid}; the importer read back {seen[:8]}...")

    check(acl.rt.unmap_mem(ptr), "aclrtUnmapMem")
    check(acl.rt.release_mem_address(ptr), "aclrtReleaseMemAddress")
    check(acl.rt.free_physical(handle), "aclrtFreePhysical")
    check(acl.rt.reset_device(DEVICE), "aclrtResetDevice")
    check(acl.finalize(), "aclFinalize")


if __name__ == "__main__":
    importer() if "--importer" in sys.argv else exporter()
