"""The CUDA backend on a real GPU: the same rules, with device memory. Skips cleanly where no GPU is usable.

Every actor runs with VMMSHARE_BACKEND=cuda on a broker of its own test; host-only machines skip the module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from procs import PROP, Actor, BrokerProc, MiB2

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")


def _gpu_usable() -> bool:
    code = "from vmmshare.backends.cuda import available; print(available())"
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return out.stdout.strip() == "True"


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_usable(), reason="no usable NVIDIA GPU / cuda-bindings")]

DEFAULT, FABRIC = 1, 2
H2D, D2H = 1, 2


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProc]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    b = BrokerProc(tmp_path, env=env)
    yield b
    b.kill()


@pytest.fixture
def gpu_actor(broker: BrokerProc) -> Iterator[Callable[..., Actor]]:
    made: list[Actor] = []

    def make(**over: str) -> Actor:
        env = {**broker.env, "VMMSHARE_BACKEND": "cuda", **over}
        a = Actor(env)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


def alloc_map(a: Actor, size: int = MiB2, loc_type: int = 1) -> tuple[int, int]:
    prop = {**PROP, "location": {"id": 0, "type": loc_type}}
    h, ret = a.call("rt.malloc_physical", size, prop, 0)
    assert ret == 0, a.last_err
    ptr, ret = a.call("rt.reserve_mem_address", size, 0, 0, 0)
    assert ret == 0, a.last_err
    assert a.call("rt.map_mem", ptr, size, 0, h, 0) == 0, a.last_err
    return h, ptr


def upload(a: Actor, ptr: int, data: bytes) -> None:
    host, ret = a.call("rt.malloc_host", len(data))
    assert ret == 0
    a.call("!write_bytes", host, data)
    assert a.call("rt.memcpy", ptr, len(data), host, len(data), H2D) == 0, a.last_err
    assert a.call("rt.free_host", host) == 0


def download(a: Actor, ptr: int, n: int) -> bytes:
    host, ret = a.call("rt.malloc_host", n)
    assert ret == 0
    assert a.call("rt.memcpy", host, n, ptr, n, D2H) == 0, a.last_err
    data: bytes = a.call("!read", host, n)
    assert a.call("rt.free_host", host) == 0
    return data


def test_gpu_memory_round_trip(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    count, ret = a.call("rt.get_device_count")
    assert ret == 0 and count >= 1
    h, ptr = alloc_map(a)
    upload(a, ptr, b"gpu!" * 1024)
    assert download(a, ptr, 4096) == b"gpu!" * 1024
    assert a.call("rt.memset", ptr, MiB2, 0x41, 16) == 0, a.last_err
    assert download(a, ptr, 16) == b"A" * 16
    assert a.call("util.ptr_to_bytes", ptr, 16) is None  # the CPU cannot read GPU memory
    assert "GPU" in a.last_err or "gpu" in a.last_err.lower()
    prop, ret = a.call("rt.mem_get_allocation_properties_from_handle", h)
    assert ret == 0 and prop["location"] == {"id": 0, "type": 1}
    assert a.call("rt.unmap_mem", ptr) == 0
    assert a.call("rt.release_mem_address", ptr) == 0
    assert a.call("rt.free_physical", h) == 0


def test_host_location_memory_stays_host_memory(gpu_actor: Callable[..., Actor]) -> None:
    a = gpu_actor()
    prop = {**PROP, "location": {"id": 0, "type": 0}}
    h, ret = a.call("rt.malloc_physical", MiB2, prop, 0)
    assert ret == 0, a.last_err
    ptr, ret = a.call("rt.reserve_mem_address", MiB2, 0, 0, 0)  # GPU address space under the CUDA backend
    assert ret == 0
    assert a.call("rt.map_mem", ptr, MiB2, 0, h, 0) == 207000
    assert "reservation" in a.last_err
    assert a.call("rt.release_mem_address", ptr) == 0
    assert a.call("rt.free_physical", h) == 0


@pytest.mark.parametrize("share_type", [DEFAULT, FABRIC])
def test_rules_hold_for_gpu_memory(gpu_actor: Callable[..., Actor], share_type: int) -> None:
    exporter, importer, stranger = gpu_actor(), gpu_actor(), gpu_actor()
    h, ptr = alloc_map(exporter, 4 * MiB2)
    pattern = bytes(range(256)) * 64
    upload(exporter, ptr, pattern)
    sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, share_type)
    assert ret == 0, exporter.last_err
    assert exporter.call("rt.mem_export_to_shareable_handle_v2", h, 0, share_type)[-1] == 107000  # rule 9
    assert exporter.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)[-1] == 107000  # rule 13
    assert stranger.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)[-1] == 207006  # rule 11
    assert exporter.call("rt.mem_set_pid_to_shareable_handle_v2", sh, share_type, [importer.pid]) == 0
    ih, ret = importer.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)
    assert ret == 0, importer.last_err
    iptr, ret = importer.call("rt.reserve_mem_address", 4 * MiB2, 0, 0, 0)
    assert importer.call("rt.map_mem", iptr, 4 * MiB2, 0, ih, 0) == 0, importer.last_err
    assert download(importer, iptr, len(pattern)) == pattern  # the same GPU memory (rule 7)
    upload(importer, iptr, b"back" * 8)
    assert download(exporter, ptr, 32) == b"back" * 8
    # rule 14: the exporter frees; new imports are refused, the importer keeps its memory
    assert exporter.call("rt.unmap_mem", ptr) == 0
    assert exporter.call("rt.free_physical", h) == 0
    assert stranger.call("rt.mem_import_from_shareable_handle_v2", sh, share_type, 0)[-1] == 107017
    assert download(importer, iptr, 32) == b"back" * 8
    assert importer.call("rt.unmap_mem", iptr) == 0
    assert importer.call("rt.free_physical", ih) == 0


def test_host_backend_importer_is_told_to_use_cuda(gpu_actor: Callable[..., Actor], broker: BrokerProc) -> None:
    exporter = gpu_actor()
    host_only = Actor({**broker.env, "VMMSHARE_BACKEND": "host"})
    try:
        h, _ = alloc_map(exporter)
        sh, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 1, DEFAULT)
        assert ret == 0
        assert host_only.call("rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)[-1] == 207000
        assert "VMMSHARE_BACKEND=cuda" in host_only.last_err
    finally:
        host_only.kill()


def test_dlpack_cuda_with_torch_across_processes(broker: BrokerProc) -> None:
    pytest.importorskip("torch")
    env = {**broker.env, "VMMSHARE_BACKEND": "cuda"}
    child = textwrap.dedent("""
        import sys, torch, vmmshare
        print(vmmshare.acl.rt.device_get_bare_tgid()[0], flush=True)
        with vmmshare.import_handle(sys.stdin.readline().strip(), device=0) as mem, mem.map() as m:
            assert m.__dlpack_device__() == (2, 0)
            t = torch.from_dlpack(m)
            assert t.is_cuda
            print(int(t[:1024].sum().item()), flush=True)
            t[:4] = 9
            torch.cuda.synchronize()
            del t
    """)
    parent = textwrap.dedent("""
        import subprocess, sys, torch, vmmshare
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        pid = int(child.stdout.readline())
        mem = vmmshare.Device(0).allocate(2 << 20)
        m = mem.map()
        t = torch.from_dlpack(m)
        t.fill_(1)
        torch.cuda.synchronize()
        h = mem.export(pids=[pid])
        child.stdin.write(f"{h}\\n"); child.stdin.flush()
        total = int(child.stdout.readline())
        assert child.wait() == 0
        assert total == 1024, total
        assert t[:4].tolist() == [9, 9, 9, 9]
        try:
            import cupy
            c = cupy.from_dlpack(m)
            assert int(c[0]) == 9
            del c
        except ImportError:
            pass
        del t
        import gc; gc.collect()
        m.close(); mem.close()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", parent, child], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
