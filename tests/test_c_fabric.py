"""The C library across servers (SPEC §8), under the sanitizers: tests/c/fabric_peer.c, built with ASan and UBSan
and the library's own sources, exports FABRIC memory on one server of a test cluster and imports, maps and copies
it on another, against C and Python programs, through every fault docs/fabric.md lists for importers. Each step's
code is checked; at the end no fd, hold or registration is left and the sanitizers found nothing.

Needs root and the transfer engine (a test cluster), and a C compiler; CI has all three.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import require
from fabric_cluster import HANG_GUARD, TestCluster, cluster_problem, eventually
from test_c_library import RUN_ENV, TESTS_C, cc
from test_fabric_sharing import (
    BAD_HANDLE,
    IPC,
    M2,
    NO_PERMISSION,
    PARAM,
    export,
    import_map,
    ok,
    served_nothing,
)

require(not cluster_problem(), cluster_problem())

FNV_OFFSET, FNV_PRIME = 1469598103934665603, 1099511628211


def fnv(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & (2**64 - 1)
    return h


def pattern(off: int, n: int) -> bytes:
    """What fabric_peer's export writes: byte i is i % 251."""
    return bytes((off + i) % 251 for i in range(n))


class Peer:
    """fabric_peer running on server `n` of a cluster, one command and one answer at a time."""

    def __init__(self, exe: Path, cluster: TestCluster, n: int) -> None:
        ns = cluster.cluster.server(n).namespace
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, str(exe)], env={**cluster.env(n), **RUN_ENV},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.pid = self.proc.pid  # `ip netns exec` execs the program: the same process

    def ask(self, line: str) -> list[str]:
        """Send one command; its answer's words after "ret" (the code first)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        assert answer and answer[0] == "ret", f"{line!r} -> {answer!r}: {self.finish()}"
        return answer[1:]

    def code(self, line: str) -> int:
        return int(self.ask(line)[0])

    def finish(self) -> str:
        """Quit; what the sanitizers said (asserted clean by the caller)."""
        try:
            _, err = self.proc.communicate("quit\n" if self.proc.poll() is None else None, timeout=HANG_GUARD)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err

    def clean(self) -> None:
        err = self.finish()
        assert self.proc.returncode == 0, err
        assert "runtime error" not in err and "ERROR: AddressSanitizer" not in err and "LeakSanitizer" not in err, err


@pytest.fixture(scope="module")
def peer_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cc(tmp_path_factory.mktemp("fabric_c") / "fabric_peer", TESTS_C / "fabric_peer.c")


@pytest.fixture
def peers(peer_exe: Path) -> Iterator[list[Peer]]:
    made: list[Peer] = []
    yield made
    for p in made:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.communicate()


def start(peers: list[Peer], exe: Path, cluster: TestCluster, n: int) -> Peer:
    p = Peer(exe, cluster, n)
    peers.append(p)
    return p


def c_export(p: Peer, size: int, *pids: int) -> bytes:
    """Export `size` bytes of `p`'s as FABRIC, trusting `pids` (none: no pid check)."""
    got = p.ask(f"export {size} {','.join(map(str, pids)) or 0}")
    assert got[0] == "0", got
    return bytes.fromhex(got[1])


def test_c_programs_export_import_and_copy_every_way_across_servers(shared_fabric: TestCluster, peer_exe: Path,
                                                                    peers: list[Peer]) -> None:
    """A C exporter on server 1, a C importer on server 2: every copy the runtime has (read, write, fill, on a
    stream, remote to remote, through a local mapping), checked on both sides; then the import is freed and nothing
    is left on either server, nor an fd in the importer."""
    a, b = start(peers, peer_exe, shared_fabric, 1), start(peers, peer_exe, shared_fabric, 2)
    s = c_export(a, 2 * M2, b.pid)
    assert len(s) == 128 and s[32] == 4
    assert b.code(f"import {s.hex()}") == 0
    before = int(b.ask("fds")[1])  # its broker connection is open from here on (and no engine's yet)
    assert b.ask(f"read 0 {2 * M2}") == ["0", str(fnv(pattern(0, 2 * M2)))]
    assert b.ask("read 4093 7") == ["0", str(fnv(pattern(4093, 7)))]
    assert b.code("write 4096 100 171") == 0
    assert a.ask("sum 4096 100") == ["0", str(fnv(b"\xab" * 100))]
    assert b.code("fill 8192 50 205") == 0
    assert b.code(f"async {M2} 4096 17") == 0
    assert a.ask("sum 8192 50")[1] == str(fnv(b"\xcd" * 50))
    assert a.ask(f"sum {M2} 4096")[1] == str(fnv(b"\x11" * 4096))
    assert b.code("between 12288 8192 50") == 0  # remote -> remote, through a bounce buffer
    assert a.ask("sum 12288 50")[1] == str(fnv(b"\xcd" * 50))
    assert b.code(f"local 0 {M2}") == 0  # remote -> a local VMM mapping -> the remote's second half
    assert a.ask(f"sum {M2} {M2}")[1] == a.ask(f"sum 0 {M2}")[1]
    assert b.code(f"read {2 * M2 - 8} 16") == PARAM  # past the memory: checked here, never sent
    assert b.code("free") == 0
    assert int(b.ask("fds")[1]) == before  # no connection to that engine kept once nothing of it is imported
    eventually(lambda: served_nothing(shared_fabric), "server 1 still serves the memory after its importer freed it")
    assert a.code("unexport") == 0
    a.clean()
    b.clean()


@pytest.mark.parametrize("way", ["c-exports", "python-exports"])
def test_c_and_python_programs_share_across_servers(shared_fabric: TestCluster, peer_exe: Path, peers: list[Peer],
                                                    way: str) -> None:
    """A C exporter's memory imported and copied by a Python program on the other server, and a Python exporter's
    by a C program; the bytes agree both ways."""
    if way == "c-exports":
        a, b = start(peers, peer_exe, shared_fabric, 1), shared_fabric.actor(2, VMMSHARE_ACTOR_SURFACE="python")
        s = c_export(a, M2, b.pid)
        ih, rp = import_map(b, s)
        buf = ok(b, "rt.malloc_host", M2)
        ok(b, "rt.memcpy", buf, M2, rp, M2, 2)
        assert b.call("!sha256", buf, M2) == hashlib.sha256(pattern(0, M2)).hexdigest()
        b.call("!write_bytes", buf, b"from python")
        ok(b, "rt.memcpy", rp + 64, 11, buf, 11, 1)
        assert a.ask("sum 64 11")[1] == str(fnv(b"from python"))
        ok(b, "rt.unmap_mem", rp)
        ok(b, "rt.release_mem_address", rp)
        ok(b, "rt.free_physical", ih)
        eventually(lambda: served_nothing(shared_fabric), "the memory is still served")
        assert a.code("unexport") == 0
        a.clean()
    else:
        b = start(peers, peer_exe, shared_fabric, 2)
        a = shared_fabric.actor(1, VMMSHARE_ACTOR_SURFACE="python")
        _, s, ap = export(a, pids=[b.pid])
        a.call("!write_bytes", ap, b"from a python exporter")
        assert b.code(f"import {s.hex()}") == 0
        assert b.ask("read 0 22")[1] == str(fnv(b"from a python exporter"))
        assert b.code("write 100 5 66") == 0
        assert a.call("!read", ap + 100, 5) == b"BBBBB"
        assert b.code("free") == 0
        eventually(lambda: served_nothing(shared_fabric), "the memory is still served")
        b.clean()


def test_trustlist_and_revocation_across_servers_from_c(shared_fabric: TestCluster, peer_exe: Path,
                                                        peers: list[Peer]) -> None:
    """Rule 11: a C importer the C exporter did not trust is refused (207006); rule 14: once the exporter frees its
    memory, a new import fails with 107017 and the importer that holds it keeps reading and writing it."""
    a = start(peers, peer_exe, shared_fabric, 1)
    b, stranger, late = (start(peers, peer_exe, shared_fabric, 2) for _ in range(3))
    s = c_export(a, M2, b.pid, late.pid)
    assert stranger.code(f"import {s.hex()}") == NO_PERMISSION
    assert b.code(f"import {s.hex()}") == 0
    assert a.code("unexport") == 0
    assert late.code(f"import {s.hex()}") == BAD_HANDLE
    assert b.ask(f"read 0 {M2}")[1] == str(fnv(pattern(0, M2)))
    assert b.code("write 0 64 9") == 0
    assert b.ask("read 0 64")[1] == str(fnv(b"\x09" * 64))
    assert b.code("free") == 0
    eventually(lambda: served_nothing(shared_fabric), "the memory is still served after its last importer freed it")
    for p in (a, b, stranger, late):
        p.clean()


def test_a_killed_exporting_broker_fails_c_copies_with_507022_and_frees_cleanly(fabric: TestCluster, peer_exe: Path,
                                                                                 peers: list[Peer]) -> None:
    """The exporting server's broker killed: the C importer's copies and fills fail with 507022 naming the peer,
    at once and every time after; freeing what it imported works, and its server's broker holds nothing more."""
    a, b = start(peers, peer_exe, fabric, 1), start(peers, peer_exe, fabric, 2)
    s = c_export(a, M2, b.pid)
    assert b.code(f"import {s.hex()}") == 0
    assert b.ask("read 0 4096")[0] == "0"
    fabric.brokers[1].signal(signal.SIGKILL)
    for _ in range(2):
        assert b.code("read 0 4096") == IPC
        assert b.code("fill 0 16 0") == IPC
    assert b.code("free") == 0
    assert fabric.brokers[2].listing()["exports"] == []
    b.clean()
    a.proc.kill()
    a.proc.communicate()


@pytest.mark.slow
def test_a_frozen_exporting_broker_times_c_copies_out_and_they_recover(fabric: TestCluster, peer_exe: Path,
                                                                        peers: list[Peer]) -> None:
    """The exporting server's broker frozen (SIGSTOP): the C importer's copies fail with 507022 once the fabric
    timeout passes without progress (1 s here), never hang; thawed, they work again on the same import."""
    a, b = start(peers, peer_exe, fabric, 1), start(peers, peer_exe, fabric, 2)
    s = c_export(a, M2, b.pid)
    assert b.code(f"import {s.hex()}") == 0
    assert b.ask(f"read 0 {M2}")[1] == str(fnv(pattern(0, M2)))
    fabric.brokers[1].signal(signal.SIGSTOP)
    try:
        assert b.code(f"read 0 {M2}") == IPC
        assert b.code("write 0 4096 1") == IPC
    finally:
        fabric.brokers[1].signal(signal.SIGCONT)
    eventually(lambda: b.code("read 0 4096") == 0, "the copy does not work again")
    assert b.ask("read 4096 4096")[1] == str(fnv(pattern(4096, 4096)))
    assert b.code("free") == 0
    eventually(lambda: served_nothing(fabric), "the memory is still served")
    b.clean()
    a.clean()


def test_a_killed_c_importer_leaves_nothing_served(shared_fabric: TestCluster, peer_exe: Path,
                                                  peers: list[Peer]) -> None:
    """A C importer killed mid-way (SIGKILL): its broker releases its holds at once, and the exporting server stops
    serving the memory; the exporter frees it as usual."""
    a, b = start(peers, peer_exe, shared_fabric, 1), start(peers, peer_exe, shared_fabric, 2)
    s = c_export(a, M2, b.pid)
    assert b.code(f"import {s.hex()}") == 0
    assert b.code(f"fill 0 {M2} 7") == 0
    b.proc.kill()
    b.proc.communicate()
    eventually(lambda: served_nothing(shared_fabric), "the memory is still served after its importer was killed")
    assert a.ask("sum 0 64")[1] == str(fnv(b"\x07" * 64))
    assert a.code("unexport") == 0
    a.clean()


def test_gpu_memory_of_a_c_program_copies_to_and_from_another_servers_memory(
        shared_fabric: TestCluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A C importer with the CUDA backend (on the CPU stand-in for the driver) copies between its GPU memory and
    another server's memory, both ways, through a host bounce buffer; the GPU memory is never served across."""
    import fakecuda

    gpu_env = {**fakecuda.build(tmp_path_factory.mktemp("fakecuda")), "VMMSHARE_BACKEND": "cuda",
               "VMMSHARE_ACTOR_SURFACE": "c"}
    a = shared_fabric.actor(1)
    b = shared_fabric.actor(2, **gpu_env)
    _, s, ap = export(a, pids=[b.pid])
    a.call("!write_bytes", ap, b"host memory of server 1")
    ih, rp = import_map(b, s)
    dev = ok(b, "rt.malloc", M2, 0)  # GPU memory (the stand-in's)
    ok(b, "rt.memcpy", dev, M2, rp, M2, 3)  # remote -> GPU
    host = ok(b, "rt.malloc_host", 64)
    ok(b, "rt.memcpy", host, 64, dev, 23, 2)
    assert b.call("!read", host, 23) == b"host memory of server 1"
    ok(b, "rt.memset", dev, 8, 0x47, 8)
    ok(b, "rt.memcpy", rp + 4096, 8, dev, 8, 3)  # GPU -> remote
    assert a.call("!read", ap + 4096, 8) == b"G" * 8
    ok(b, "rt.free", dev)
    ok(b, "rt.free_host", host)
    ok(b, "rt.unmap_mem", rp)
    ok(b, "rt.release_mem_address", rp)
    ok(b, "rt.free_physical", ih)
    eventually(lambda: served_nothing(shared_fabric), "the memory is still served")
