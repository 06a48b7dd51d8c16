"""Physical memory sharing without a trustlist (ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION), with the
V1 calls, with `vmmshare.acl` (written for vmmshare from the runtime's API documentation): any process that can
reach the node's broker
may import, so the exporter never needs the importer's pid. Needs numpy. Run from the repository root, after
``scripts/setup.sh``: ``.venv/bin/python examples/share_without_trustlist.py``.
"""

import subprocess
import sys

import numpy as np

import vmmshare.acl as acl

SIZE = 4 * 1024 * 1024


def check(ret, what):
    if ret != acl.ACL_SUCCESS:
        raise SystemExit(f"{what} failed: {ret} {acl.get_recent_err_msg()}")


def importer(shareable):
    check(acl.rt.set_device(1), "aclrtSetDevice")
    handle, ret = acl.rt.mem_import_from_shareable_handle(shareable, 1)  # V1: the device is explicit
    check(ret, "aclrtMemImportFromShareableHandle")
    ptr, ret = acl.rt.reserve_mem_address(SIZE, 0, 0, 0)
    check(ret, "aclrtReserveMemAddress")
    check(acl.rt.map_mem(ptr, SIZE, 0, handle, 0), "aclrtMapMem")
    values = acl.util.ptr_to_numpy(ptr, (SIZE // 4,), np.int32)
    print(int(values.sum()))
    values[:] = -values  # write back through the shared mapping
    del values
    check(acl.rt.unmap_mem(ptr), "aclrtUnmapMem")
    check(acl.rt.release_mem_address(ptr), "aclrtReleaseMemAddress")
    check(acl.rt.free_physical(handle), "aclrtFreePhysical")


def exporter():
    check(acl.rt.set_device(0), "aclrtSetDevice")
    prop = {"handleType": 0, "allocationType": 0, "memAttr": acl.ACL_HBM_MEM_NORMAL,
            "location": {"id": 0, "type": acl.ACL_MEM_LOCATION_TYPE_DEVICE}, "reserve": 0}
    handle, ret = acl.rt.malloc_physical(SIZE, prop, 0)
    check(ret, "aclrtMallocPhysical")
    ptr, ret = acl.rt.reserve_mem_address(SIZE, 0, 0, 0)
    check(ret, "aclrtReserveMemAddress")
    check(acl.rt.map_mem(ptr, SIZE, 0, handle, 0), "aclrtMapMem")
    host = np.arange(SIZE // 4, dtype=np.int32)
    check(acl.rt.memcpy(ptr, SIZE, acl.util.numpy_to_ptr(host), SIZE, acl.ACL_MEMCPY_HOST_TO_DEVICE), "aclrtMemcpy")

    shareable, ret = acl.rt.mem_export_to_shareable_handle(
        handle, acl.ACL_MEM_HANDLE_TYPE_NONE, acl.ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION
    )
    check(ret, "aclrtMemExportToShareableHandle")
    out = subprocess.run([sys.executable, __file__, str(shareable)], capture_output=True, text=True, check=True)
    assert int(out.stdout) == int(host.sum(dtype=np.int64)), out.stdout

    back = np.empty_like(host)
    check(acl.rt.memcpy(acl.util.numpy_to_ptr(back), SIZE, ptr, SIZE, acl.ACL_MEMCPY_DEVICE_TO_HOST), "aclrtMemcpy")
    assert (back == -host).all(), "the importer's writes are not visible"
    print(f"exported {shareable:#x} without a trustlist; the importer summed and negated {SIZE // 4} ints")
    check(acl.rt.unmap_mem(ptr), "aclrtUnmapMem")
    check(acl.rt.release_mem_address(ptr), "aclrtReleaseMemAddress")
    check(acl.rt.free_physical(handle), "aclrtFreePhysical")


if __name__ == "__main__":
    importer(int(sys.argv[1])) if len(sys.argv) > 1 else exporter()
