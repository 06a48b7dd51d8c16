"""What differs by kind of memory is said by each backend (the runtime never asks what kind it holds)."""

from __future__ import annotations

import pytest

from vmmshare.backends import host as host_memory
from vmmshare.backends.base import MemoryKind
from vmmshare.backends.cuda import CudaBackend
from vmmshare.backends.host import HostBackend
from vmmshare.backends.remote import RemoteBackend, RemoteMemory
from vmmshare.errors import InvalidParamError


@pytest.mark.parametrize(("backend", "kind", "name", "on_gpu", "remote", "cpu_access"), [
    (HostBackend, MemoryKind.HOST, "host", False, False, True),
    (CudaBackend, MemoryKind.GPU, "GPU", True, False, False),
    (RemoteBackend, MemoryKind.REMOTE, "remote", False, True, False),
])
def test_each_backend_says_what_its_memory_allows(backend: type, kind: MemoryKind, name: str, on_gpu: bool,
                                                   remote: bool, cpu_access: bool) -> None:
    assert (backend.kind, backend.name, backend.on_gpu, backend.remote, backend.cpu_access) == (
        kind, name, on_gpu, remote, cpu_access)


def test_remote_transfers_refuse_local_memory_and_ranges_past_the_import() -> None:
    """The engine is never handed an address outside what another server serves, nor local memory as remote."""
    calls: list[tuple[str, int, int, int]] = []

    class Engine:
        def read(self, segment: str, local: int, remote: int, size: int) -> None:
            calls.append(("read", local, remote, size))

        def write(self, segment: str, local: int, remote: int, size: int) -> None:
            calls.append(("write", local, remote, size))

    backend = RemoteBackend(Engine)
    local = host_memory.allocate(2 << 20, hugetlb=False)
    try:
        with pytest.raises(InvalidParamError, match="not memory of another server"):
            backend.read(local, 0, 0x1000, 16)
    finally:
        local.close()
    far = RemoteMemory("10.0.0.1:7000", 0x10000, 4096)
    with pytest.raises(InvalidParamError, match="run past the remote memory"):
        backend.write(far, 4000, 0x1000, 200)
    backend.read(far, 96, 0x1000, 4000)
    assert calls == [("read", 0x1000, 0x10000 + 96, 4000)]
