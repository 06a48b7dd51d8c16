"""Device memory shared by IPC key (the aclrtIpcMem* flow the runtime documents), with `vmmshare.acl`; written
for vmmshare from the runtime's API documentation.

Process A allocates device memory with aclrtMalloc, fills it on a stream, exports an IPC key with the pid
trustlist on, and trusts process B's bare tgid. Process B imports the key, reads the memory through the pointer it
got, writes an answer into it, and closes its import; then A closes the key and frees the memory (B closes first,
as the reference asks). Run: ``python examples/share_ipc_memory.py``.
"""

import ctypes
import subprocess
import sys

import vmmshare.acl as acl

SIZE = 1024 * 1024
DEVICE = 0
KEY_LEN = 65


def check(ret, what):
    if ret != acl.ACL_SUCCESS:
        raise SystemExit(f"{what} failed: {ret} {acl.get_recent_err_msg()}")


def process_b():
    check(acl.init(), "aclInit")
    check(acl.rt.set_device(DEVICE), "aclrtSetDevice")
    pid, ret = acl.rt.device_get_bare_tgid()
    check(ret, "aclrtDeviceGetBareTgid")
    print(pid, flush=True)  # A puts this pid on the key's trustlist
    key = sys.stdin.readline().strip()
    ptr, ret = acl.rt.ipc_mem_import_by_key(key, acl.ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT)
    check(ret, "aclrtIpcMemImportByKey")
    host, ret = acl.rt.malloc_host(SIZE)
    check(ret, "aclrtMallocHost")
    check(acl.rt.memcpy(host, SIZE, ptr, SIZE, acl.ACL_MEMCPY_DEVICE_TO_HOST), "aclrtMemcpy")
    total = sum(ctypes.string_at(host, SIZE))
    ctypes.memmove(ptr, b"B saw %d" % total, 16)  # the answer, written through the shared pointer
    print(total, flush=True)
    check(acl.rt.free_host(host), "aclrtFreeHost")
    check(acl.rt.ipc_mem_close(key), "aclrtIpcMemClose")
    check(acl.rt.reset_device(DEVICE), "aclrtResetDevice")
    check(acl.finalize(), "aclFinalize")


def process_a():
    check(acl.init(), "aclInit")
    check(acl.rt.set_device(DEVICE), "aclrtSetDevice")
    stream, ret = acl.rt.create_stream()
    check(ret, "aclrtCreateStream")
    ptr, ret = acl.rt.malloc(SIZE, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    check(ret, "aclrtMalloc")
    check(acl.rt.memset_async(ptr, SIZE, 3, SIZE, stream), "aclrtMemsetAsync")
    check(acl.rt.synchronize_stream(stream), "aclrtSynchronizeStream")

    key, ret = acl.rt.ipc_mem_get_export_key(ptr, SIZE, KEY_LEN, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)
    check(ret, "aclrtIpcMemGetExportKey")
    b = subprocess.Popen([sys.executable, __file__, "--b"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    b_pid = int(b.stdout.readline())
    check(acl.rt.ipc_mem_set_import_pid(key, [b_pid]), "aclrtIpcMemSetImportPid")
    b.stdin.write(key + "\n")
    b.stdin.flush()
    total = int(b.stdout.readline())
    assert b.wait() == 0, "process B failed"
    assert total == 3 * SIZE, f"B read {total}"
    answer = ctypes.string_at(ptr, 16).rstrip(b"\0").decode()
    assert answer == f"B saw {3 * SIZE}"[:16], answer
    print(f"shared {SIZE} bytes by key {key} with pid {b_pid}; it wrote back {answer!r}")

    check(acl.rt.ipc_mem_close(key), "aclrtIpcMemClose")  # after B's close
    check(acl.rt.free(ptr), "aclrtFree")
    check(acl.rt.destroy_stream(stream), "aclrtDestroyStream")
    check(acl.rt.reset_device(DEVICE), "aclrtResetDevice")
    check(acl.finalize(), "aclFinalize")


if __name__ == "__main__":
    process_b() if "--b" in sys.argv else process_a()
