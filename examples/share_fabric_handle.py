"""Physical memory sharing with a FABRIC handle (aclrtMemFabricHandle, 128 bytes) on the same server,
with `vmmshare.acl` (written for vmmshare from the runtime's API documentation). The 128 bytes travel as hex on
the command line; an
importer on another server would need the cross-server transport.
Run from the repository root, after ``scripts/setup.sh``: ``.venv/bin/python examples/share_fabric_handle.py``.
"""

import ctypes
import subprocess
import sys

import vmmshare.acl as acl

SIZE = 2 * 1024 * 1024
FABRIC = acl.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC


def check(ret, what):
    if ret != acl.ACL_SUCCESS:
        raise SystemExit(f"{what} failed: {ret} {acl.get_recent_err_msg()}")


def importer(fabric_hex):
    check(acl.rt.set_device(0), "aclrtSetDevice")
    fabric = bytes.fromhex(fabric_hex)
    pid, ret = acl.rt.device_get_bare_tgid()
    check(ret, "aclrtDeviceGetBareTgid")
    print(pid, flush=True)
    sys.stdin.readline()  # wait until the exporter trustlisted us
    handle, ret = acl.rt.mem_import_from_shareable_handle_v2(fabric, FABRIC, 0)
    check(ret, "aclrtMemImportFromShareableHandleV2")
    ptr, ret = acl.rt.reserve_mem_address(SIZE, 0, 0, 0)
    check(ret, "aclrtReserveMemAddress")
    check(acl.rt.map_mem(ptr, SIZE, 0, handle, 0), "aclrtMapMem")
    print(ctypes.string_at(ptr, 5).decode(), flush=True)
    check(acl.rt.unmap_mem(ptr), "aclrtUnmapMem")
    check(acl.rt.release_mem_address(ptr), "aclrtReleaseMemAddress")
    check(acl.rt.free_physical(handle), "aclrtFreePhysical")


def exporter():
    check(acl.rt.set_device(0), "aclrtSetDevice")
    prop = {"handleType": 0, "allocationType": 0, "memAttr": acl.ACL_HBM_MEM_HUGE,
            "location": {"id": 0, "type": acl.ACL_MEM_LOCATION_TYPE_DEVICE}, "reserve": 0}
    handle, ret = acl.rt.malloc_physical(SIZE, prop, 0)
    check(ret, "aclrtMallocPhysical")
    ptr, ret = acl.rt.reserve_mem_address(SIZE, 0, 0, 0)
    check(ret, "aclrtReserveMemAddress")
    check(acl.rt.map_mem(ptr, SIZE, 0, handle, 0), "aclrtMapMem")
    message = b"hello"
    check(acl.rt.memcpy(ptr, SIZE, acl.util.bytes_to_ptr(message), len(message), acl.ACL_MEMCPY_HOST_TO_DEVICE),
          "aclrtMemcpy")

    fabric, ret = acl.rt.mem_export_to_shareable_handle_v2(handle, acl.ACL_RT_VMM_EXPORT_FLAG_DEFAULT, FABRIC)
    check(ret, "aclrtMemExportToShareableHandleV2")
    assert isinstance(fabric, bytes) and len(fabric) == 128 and fabric[:4] == b"VMMF"
    child = subprocess.Popen([sys.executable, __file__, fabric.hex()], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    pid = int(child.stdout.readline())
    check(acl.rt.mem_set_pid_to_shareable_handle_v2(fabric, FABRIC, [pid]), "aclrtMemSetPidToShareableHandleV2")
    child.stdin.write("go\n")
    child.stdin.flush()
    seen = child.stdout.readline().strip()
    assert child.wait() == 0 and seen == "hello", seen
    print(f"FABRIC handle {fabric[:16].hex()}... imported by pid {pid}, which read {seen!r}")
    check(acl.rt.unmap_mem(ptr), "aclrtUnmapMem")
    check(acl.rt.release_mem_address(ptr), "aclrtReleaseMemAddress")
    check(acl.rt.free_physical(handle), "aclrtFreePhysical")


if __name__ == "__main__":
    importer(sys.argv[1]) if len(sys.argv) > 1 else exporter()
