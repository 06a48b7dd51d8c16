"""GPU memory shared between two processes: a producer fills it, a consumer maps the same GPU memory and answers.

Needs an NVIDIA GPU, cuda-bindings (``pip install 'vmmshare[cuda]'``) and the CUDA backend. Run from the repository
root, after ``scripts/setup.sh``: ``VMMSHARE_BACKEND=cuda .venv/bin/python examples/gpu_share.py``. Without GPU
memory it says so and exits with status 1. With a CUDA build of torch the consumer works on the memory as a torch
tensor (DLPack, zero-copy); without one it uses ``acl.rt.memcpy``.
"""

import ctypes
import subprocess
import sys

import vmmshare
import vmmshare.acl as acl

SIZE = 8 << 20
DEVICE_TO_HOST, HOST_TO_DEVICE = 2, 1


def torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def check(ret):
    if ret != 0:
        raise SystemExit(f"failed with {ret}: {acl.get_recent_err_msg()}")


def consumer(text):
    torch = torch_cuda()
    with vmmshare.import_handle(text, device=0) as memory, memory.map() as mapping:
        if torch is not None:
            tensor = torch.from_dlpack(mapping)  # uint8 on cuda:0, the producer's memory
            total = int(tensor.sum().item())
            tensor[-4:] = ord("!")
            torch.cuda.synchronize()
            del tensor
        else:
            host = (ctypes.c_uint8 * SIZE)()
            check(acl.rt.memcpy(ctypes.addressof(host), SIZE, mapping.ptr, SIZE, DEVICE_TO_HOST))
            total = sum(memoryview(host).cast("B"))
            answer = (ctypes.c_uint8 * 4).from_buffer_copy(b"!!!!")
            check(acl.rt.memcpy(mapping.ptr + SIZE - 4, 4, ctypes.addressof(answer), 4, HOST_TO_DEVICE))
        print(total)


def producer():
    try:
        memory = vmmshare.Device(0).allocate(SIZE)
    except vmmshare.AclError as exc:  # e.g. VMMSHARE_BACKEND=cuda without cuda-bindings or a usable GPU
        raise SystemExit(f"gpu_share.py: no GPU memory: {exc.message}") from None
    with memory, memory.map() as mapping:
        if mapping.__dlpack_device__() != (2, 0):
            raise SystemExit("gpu_share.py: device memory is host memory here, not GPU memory: run it with "
                             "VMMSHARE_BACKEND=cuda on a machine with an NVIDIA GPU")
        check(acl.rt.memset(mapping.ptr, SIZE, 1, SIZE))  # every byte 1
        child = subprocess.Popen([sys.executable, __file__, "--consumer"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        handle = memory.export(pids=[child.pid])
        out, _ = child.communicate(f"{handle}\n")
        if child.returncode != 0:
            raise SystemExit(f"gpu_share.py: the consumer failed ({child.returncode})")
        if int(out) != SIZE:
            raise SystemExit(f"gpu_share.py: the consumer saw a sum of {out.strip()}, not {SIZE}")
        tail = (ctypes.c_uint8 * 4)()
        check(acl.rt.memcpy(ctypes.addressof(tail), 4, mapping.ptr + SIZE - 4, 4, DEVICE_TO_HOST))
        if bytes(tail) != b"!!!!":
            raise SystemExit("gpu_share.py: the consumer's answer is not in the GPU memory")
        print(f"{handle} shared {SIZE >> 20} MiB of GPU memory; the consumer read it all and wrote its answer")


if __name__ == "__main__":
    if "--consumer" in sys.argv:
        consumer(sys.stdin.readline().strip())
    else:
        producer()
