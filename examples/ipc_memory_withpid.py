"""IPC memory sharing with the pid trustlist on, with `vmmshare.acl`: a program written for vmmshare from the
runtime's API documentation, following the flow its documentation gives for the IPC sample with pid validation.

Two processes on one device. Process B gives its bare tgid first; process A allocates device memory, writes 123
into it, exports an IPC key (flags 0: pid validation on), puts B on the key's trustlist and hands B the key; B
imports the key, reads the value through its own pointer and signals completion; both close the key and release
what they hold. Where the documented flow passes the pid, the key and the completion flag through files, here A
starts B and they pass them through B's standard input and output (B's log goes to standard error). Run:
``python examples/ipc_memory_withpid.py``.
"""

import ctypes
import subprocess
import sys

import vmmshare.acl as acl

SIZE = 1 * 1024 * 1024
DEVICE = 0
KEY_LEN = 65
VALUE = 123


def check(ret, what):
    if ret != acl.ACL_SUCCESS:
        raise SystemExit(f"{what} failed: {ret} {acl.get_recent_err_msg()}")


def info(who, text):
    print(f"[INFO]  Process {who}: {text}", file=sys.stderr if who == "B" else sys.stdout, flush=True)


def send(out, text):
    out.write(text + "\n")
    out.flush()


def receive(source, what):
    line = source.readline()
    if not line:
        raise SystemExit(f"[ERROR] the other process ended before sending {what}")
    return line.strip()


def start():
    check(acl.init(), "aclInit")
    check(acl.rt.set_device(DEVICE), "aclrtSetDevice")
    stream, ret = acl.rt.create_stream()
    check(ret, "aclrtCreateStream")
    return stream


def finish(stream):
    check(acl.rt.destroy_stream_force(stream), "aclrtDestroyStreamForce")
    check(acl.rt.reset_device_force(DEVICE), "aclrtResetDeviceForce")
    check(acl.finalize(), "aclFinalize")


def process_b():
    stream = start()
    pid, ret = acl.rt.device_get_bare_tgid()
    check(ret, "aclrtDeviceGetBareTgid")
    info("B", "get Process B's pid successfully")
    send(sys.stdout, str(pid))
    key = receive(sys.stdin, "the key")
    info("B", f"get the shareable memory identifier successfully, shareable identifier = {key}")
    dev_ptr, ret = acl.rt.ipc_mem_import_by_key(key, 0)
    check(ret, "aclrtIpcMemImportByKey")
    value = ctypes.c_int32()
    check(acl.rt.memcpy(ctypes.addressof(value), 4, dev_ptr, 4, acl.ACL_MEMCPY_DEVICE_TO_HOST), "aclrtMemcpy")
    print(f"Destination data: {value.value}", file=sys.stderr, flush=True)
    send(sys.stdout, f"1 {value.value}")
    info("B", "complete ipc memory sharing")
    check(acl.rt.ipc_mem_close(key), "aclrtIpcMemClose")  # unmaps B's pointer: nothing else to free
    finish(stream)


def process_a(b):
    stream = start()
    dev_ptr, ret = acl.rt.malloc(SIZE, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    check(ret, "aclrtMalloc")
    info("A", f"allocate memory on the device {dev_ptr:#x} successfully")
    value = ctypes.c_int32(VALUE)
    check(acl.rt.memcpy_async(dev_ptr, SIZE, ctypes.addressof(value), 4, acl.ACL_MEMCPY_HOST_TO_DEVICE, stream),
          "aclrtMemcpyAsync")
    check(acl.rt.synchronize_stream(stream), "aclrtSynchronizeStream")
    info("A", f"write data {VALUE} to the device address {dev_ptr:#x}")

    key, ret = acl.rt.ipc_mem_get_export_key(dev_ptr, SIZE, KEY_LEN, acl.ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT)
    check(ret, "aclrtIpcMemGetExportKey")
    info("A", f"get the shareable memory identifier {key} successfully")
    pid = int(receive(b.stdout, "its pid"))
    info("A", f"get Process B's pid successfully, Process B's pid = {pid}")
    check(acl.rt.ipc_mem_set_import_pid(key, [pid]), "aclrtIpcMemSetImportPid")
    info("A", "add Process B to the whitelist successfully")
    send(b.stdin, key)
    flag, seen = map(int, receive(b.stdout, "the completion flag").split())
    info("A", f"receive the completion signal from Process B, completion signal = {flag}")
    print(f"Source data: {VALUE}", flush=True)
    if seen != VALUE:
        raise SystemExit(f"[ERROR] Process B read {seen}, not {VALUE}")
    print(f"[SUCCESS] IPC memory sharing successfully. Values at source and destination are equal: {VALUE}")

    check(acl.rt.ipc_mem_close(key), "aclrtIpcMemClose")
    check(acl.rt.free(dev_ptr), "aclrtFree")
    finish(stream)


def main():
    b = subprocess.Popen([sys.executable, __file__, "--b"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        process_a(b)
    except BaseException:
        b.kill()
        b.wait()
        raise
    b.stdin.close()
    if b.wait() != 0:
        raise SystemExit("[ERROR] process B failed")


if __name__ == "__main__":
    process_b() if "--b" in sys.argv else main()
