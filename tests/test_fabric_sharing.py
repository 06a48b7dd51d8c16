"""FABRIC handles across servers (SPEC §8, rule 17): the sharing sample flow and every sharing rule, between
"servers" that are network namespaces of this machine, each with its own broker, server id and fabric address.

Needs root and the transfer engine; CI has both, so there these tests must run (VMMSHARE_REQUIRE_ROOT_TESTS).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import require
from fabric_cluster import TestCluster, cluster_problem, eventually
from procs import Actor, fails, ok

require(not cluster_problem(), cluster_problem())

FABRIC, DEFAULT = 2, 1
NO_PID_CHECK = 1
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
HOST_PROP = {**PROP, "location": {"id": 0, "type": 0}}
M2 = 2 << 20
PARAM, BAD_HANDLE, NOT_SUPPORTED, NO_PERMISSION, IPC = 107000, 107017, 207000, 207006, 507022


def export(a: Actor, size: int = M2, flags: int = 0, pids: list[int] | None = None,
           prop: dict[str, Any] | None = None) -> tuple[int, bytes, int]:
    """Allocate, map and export as FABRIC on `a`: (handle, shareable, ptr of the exporter's own mapping)."""
    h = ok(a, "rt.malloc_physical", size, prop or PROP, 0)
    p = ok(a, "rt.reserve_mem_address", size, 0, 0, 0)
    ok(a, "rt.map_mem", p, size, 0, h, 0)
    s = ok(a, "rt.mem_export_to_shareable_handle_v2", h, flags, FABRIC)
    if pids:
        ok(a, "rt.mem_set_pid_to_shareable_handle_v2", s, FABRIC, pids)
    return h, s, p


def import_map(a: Actor, s: bytes, size: int = M2) -> tuple[int, int]:
    h = ok(a, "rt.mem_import_from_shareable_handle_v2", s, FABRIC, 0)
    p = ok(a, "rt.reserve_mem_address", size, 0, 0, 0)
    ok(a, "rt.map_mem", p, size, 0, h, 0)
    return h, p


def copying(c: TestCluster) -> tuple[Actor, int, int, int]:
    """Server 2's process with server 1's FABRIC memory imported, mapped and copied from once (its engine up):
    (that process, its imported handle, its mapping, its 4 KiB host buffer)."""
    a, b = c.actor(1), c.actor(2)
    _, s, _ = export(a, pids=[b.pid])
    ih, rp = import_map(b, s)
    buf = ok(b, "rt.malloc_host", 4096)
    ok(b, "rt.memcpy", buf, 4096, rp, 4096, 2)
    return b, ih, rp, buf


def unmap_free(a: Actor, h: int, p: int) -> None:
    ok(a, "rt.unmap_mem", p)
    ok(a, "rt.release_mem_address", p)
    ok(a, "rt.free_physical", h)


def served_nothing(c: TestCluster, n: int = 1) -> bool:
    """Server `n`'s broker serves nothing to other servers: no remote importer listed, no memfd mapped."""
    b = c.brokers[n]
    rows = b.listing()["exports"]
    return b.memfd_mappings() == 0 and not any(r.get("remote_importers") for r in rows)


# ---------------------------------------------------------------- both surfaces


@pytest.fixture(params=["python", "c"])
def fab(request: pytest.FixtureRequest, shared_fabric: TestCluster) -> Iterator[TestCluster]:
    """The module's cluster with every actor on one surface: vmmshare.acl, or the C library (libascendcl.so) through
    `cacl`, so that each rule across servers runs on both."""
    shared_fabric.surfaces = {1: request.param, 2: request.param}
    yield shared_fabric
    shared_fabric.surfaces = {}


@pytest.fixture(params=["python-python", "c-c", "c-python", "python-c"])
def pair(request: pytest.FixtureRequest, shared_fabric: TestCluster) -> Iterator[TestCluster]:
    """The module's cluster with server 1's actors (the exporters) on one surface and server 2's (the importers) on
    another: each way between a C and a Python program."""
    exporter, importer = request.param.split("-")
    shared_fabric.surfaces = {1: exporter, 2: importer}
    yield shared_fabric
    shared_fabric.surfaces = {}


# ---------------------------------------------------------------- the sample flow


def test_the_sharing_sample_flow_across_servers(pair: TestCluster) -> None:
    """Server 1 exports and trustlists server 2's process by its bare tgid; server 2 imports, maps, and copies in
    every direction between that range and its own memory (malloc_host, malloc, a local VMM mapping), and sets it:
    C and Python programs, each way."""
    shared_fabric = pair
    a, b = shared_fabric.actor(1), shared_fabric.actor(2)
    tgid = ok(b, "rt.device_get_bare_tgid")
    assert tgid == b.pid
    _, s, ap = export(a, 2 * M2, pids=[tgid])
    assert len(s) == 128 and s[32] == 4  # the endpoint: IPv4, server 1's address
    a.call("!write_bytes", ap, b"written on server 1")
    a.call("!write", ap + M2, 0x5A, M2)

    ih, rp = import_map(b, s, 2 * M2)
    buf = ok(b, "rt.malloc_host", 2 * M2)
    ok(b, "rt.memcpy", buf, 2 * M2, rp, 2 * M2, 4)  # remote -> host
    assert b.call("!read", buf, 19) == b"written on server 1"
    assert b.call("!sha256", buf + M2, M2) == hashlib.sha256(b"\x5a" * M2).hexdigest()

    b.call("!write_bytes", buf, b"back from server 2")
    ok(b, "rt.memcpy", rp + 4096, 64, buf, 18, 1)  # host -> remote (HOST_TO_DEVICE: a remote range is device memory)
    assert a.call("!read", ap + 4096, 18) == b"back from server 2"

    dev = ok(b, "rt.malloc", M2, 0)  # aclrtMalloc memory <-> remote
    ok(b, "rt.memcpy", dev, M2, rp, M2, 3)
    ok(b, "rt.memcpy", rp + M2, M2, dev, M2, 3)
    assert a.call("!read", ap + M2, 19) == b"written on server 1"

    lh = ok(b, "rt.malloc_physical", M2, PROP, 0)  # a local VMM mapping <-> remote
    lp = ok(b, "rt.reserve_mem_address", M2, 0, 0, 0)
    ok(b, "rt.map_mem", lp, M2, 0, lh, 0)
    b.call("!write", lp, 0xC3, M2)
    ok(b, "rt.memcpy", rp, M2, lp, M2, 3)
    assert a.call("!sha256", ap, M2) == hashlib.sha256(b"\xc3" * M2).hexdigest()
    ok(b, "rt.memcpy", rp + 100, 10, rp + M2, 10, 3)  # remote -> remote (through a bounce buffer)
    assert a.call("!read", ap + 100, 10) == b"written on"

    ok(b, "rt.memset", rp + 8, 16, 0x7E, 16)
    assert a.call("!read", ap, 24) == b"\xc3" * 8 + b"\x7e" * 16

    fails(b, PARAM, "rt.memcpy", buf, 64, rp, 64, 0)  # HOST_TO_HOST: the remote side is device memory
    ok(b, "rt.unmap_mem", lp)  # the local ranges may lie right after the remote one (rule 7: one range then)
    ok(b, "rt.free", dev)
    fails(b, PARAM, "rt.memcpy", buf, 64, rp + 2 * M2 - 8, 64, 4)  # runs past the mapping: checked here

    ok(b, "rt.unmap_mem", rp)
    for p in (lp, rp):
        ok(b, "rt.release_mem_address", p)
    ok(b, "rt.free_physical", lh)
    ok(b, "rt.free_physical", ih)
    ok(b, "rt.free_host", buf)
    eventually(lambda: served_nothing(shared_fabric), "server 1 still serves the memory after its importer freed it")


def test_the_pythonic_flow_across_servers(shared_fabric: TestCluster) -> None:
    a = shared_fabric.actor(1)
    importer = shared_fabric.cluster.server(2)
    _, s, ap = export(a, M2, flags=NO_PID_CHECK)
    a.call("!write_bytes", ap, b"pythonic")
    code = f"""
import vmmshare, vmmshare.acl as acl
from vmmshare import FeatureNotSupportedError
with vmmshare.import_handle(bytes.fromhex({s.hex()!r})) as mem, mem.map() as m:
    assert mem.remote and m.remote and not mem.on_gpu
    assert m.read(8) == b"pythonic"
    m.write(b"PY", offset=2)
    m.fill(0x41, size=4, offset=100)
    with vmmshare.Device(0).allocate(1 << 21) as local, local.map() as lm:
        lm.write(b"local bytes")
        m.copy_from(lm, size=11, offset=200)
        lm.copy_from(m, size=8)
        assert lm.read(8) == m.read(8) == b"pyPYonic"
    for view in (lambda: m.numpy(), lambda: m.memoryview(), lambda: m.__dlpack__()):
        try:
            view()
        except FeatureNotSupportedError as exc:
            assert exc.code == 207000 and "another server" in exc.message, exc.message
        else:
            raise AssertionError("a CPU view of remote memory")
    assert acl.util.ptr_to_numpy(m.ptr, (4,), 2) is None
    assert "another server" in acl.get_recent_err_msg()
    assert acl.util.ptr_to_bytes(m.ptr, 4) is None
print("OK")
"""
    out = shared_fabric.run(importer.number, code)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
    assert a.call("!read", ap, 8) == b"pyPYonic"
    assert a.call("!read", ap + 100, 4) == b"AAAA"
    assert a.call("!read", ap + 200, 11) == b"local bytes"
    eventually(lambda: served_nothing(shared_fabric), "the memory is still served after the importer's process ended")


# ---------------------------------------------------------------- the rules across servers


def test_rule_11_only_trusted_pids_of_other_servers_import(fab: TestCluster) -> None:
    shared_fabric = fab
    a, b, c = shared_fabric.actor(1), shared_fabric.actor(2), shared_fabric.actor(2)
    imp = "rt.mem_import_from_shareable_handle_v2"
    _, s, _ = export(a, pids=[b.pid])
    msg = fails(c, NO_PERMISSION, imp, s, FABRIC, 0)
    assert str(c.pid) in msg and f"{shared_fabric.server_id(2):#x}" in msg and "trustlist" in msg
    ok(a, "rt.mem_set_pid_to_shareable_handle_v2", s, FABRIC, [c.pid])  # added later: in from then on
    for x in (b, c):
        ok(x, "rt.free_physical", ok(x, imp, s, FABRIC, 0))
    _, g, _ = export(a, flags=NO_PID_CHECK)  # no validation: any process of any server in the cluster
    ok(c, "rt.free_physical", ok(c, imp, g, FABRIC, 0))
    eventually(lambda: served_nothing(shared_fabric), "remote holds left behind")


@pytest.mark.parametrize("importer", ["python", "c"])
def test_rule_11_server_and_pid_pairs_admit_that_servers_pid_only(shared_fabric: TestCluster, importer: str) -> None:
    """`allow(server=)` is the Pythonic objects' (the exporter is a Python program); the importer is either."""
    a, b = shared_fabric.actor(1), shared_fabric.actor(2, VMMSHARE_ACTOR_SURFACE=importer)
    imp = "rt.mem_import_from_shareable_handle_v2"
    _, s, _ = export(a)
    a.call("!allow_server", s, shared_fabric.server_id(2) ^ 0xFF, [b.pid])  # b's pid, but of a server b is not on
    fails(b, NO_PERMISSION, imp, s, FABRIC, 0)
    a.call("!allow_server", s, shared_fabric.server_id(2), [b.pid])
    h = ok(b, imp, s, FABRIC, 0)
    rows = shared_fabric.brokers[1].listing()["exports"]
    assert rows[0]["remote_importers"] == [f"{shared_fabric.server_id(2):#x}:{b.pid}"]
    assert f"{shared_fabric.server_id(2):#x}:{b.pid}" in rows[0]["remote_trustlist"]
    ok(b, "rt.free_physical", h)
    eventually(lambda: served_nothing(shared_fabric), "remote holds left behind")


def test_rule_11_an_ipc_entry_of_another_server_admits_that_servers_pid_only(fab: TestCluster) -> None:
    shared_fabric = fab
    """ipc_mem_import_pid_inter_server: {sdid, pids} admits those pids of server sdid, not the same pid numbers on
    the exporter's own server."""
    a, local = shared_fabric.actor(1), shared_fabric.actor(1)
    ptr = ok(a, "rt.malloc", 4096, 0)
    key = ok(a, "rt.ipc_mem_get_export_key", ptr, 4096, 65, 0)
    ok(a, "rt.ipc_mem_import_pid_inter_server", key, [{"sdid": shared_fabric.server_id(2), "pid": [local.pid]}])
    fails(local, NO_PERMISSION, "rt.ipc_mem_import_by_key", key, 0)
    ok(a, "rt.ipc_mem_import_pid_inter_server", key, [{"sdid": shared_fabric.server_id(1), "pid": [local.pid]}])
    q = ok(local, "rt.ipc_mem_import_by_key", key, 0)
    ok(local, "rt.ipc_mem_close", key)
    assert q
    ok(a, "rt.ipc_mem_close", key)
    ok(a, "rt.free", ptr)


def test_rule_12_only_the_exporting_process_sets_the_trustlist(fab: TestCluster) -> None:
    shared_fabric = fab
    a, b, neighbour = shared_fabric.actor(1), shared_fabric.actor(2), shared_fabric.actor(1)
    _, s, _ = export(a)
    msg = fails(b, NO_PERMISSION, "rt.mem_set_pid_to_shareable_handle_v2", s, FABRIC, [b.pid])
    assert f"{shared_fabric.server_id(1):#x}" in msg
    fails(neighbour, NO_PERMISSION, "rt.mem_set_pid_to_shareable_handle_v2", s, FABRIC, [b.pid])
    fails(b, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", s, FABRIC, 0)  # none of it took effect


def test_rule_13_the_same_handle_twice_in_one_process(fab: TestCluster) -> None:
    shared_fabric = fab
    a, b = shared_fabric.actor(1), shared_fabric.actor(2)
    imp = "rt.mem_import_from_shareable_handle_v2"
    _, s, _ = export(a, pids=[b.pid])
    h = ok(b, imp, s, FABRIC, 0)
    assert ok(b, imp, s, FABRIC, 0) == h  # again: the same handle, a reference added
    doctored = bytearray(s)
    doctored[12] ^= 1  # another device id: still the same handle
    assert ok(b, imp, bytes(doctored), FABRIC, 0) == h
    for _ in range(3):
        ok(b, "rt.free_physical", h)
    ok(b, "rt.free_physical", ok(b, imp, s, FABRIC, 0))  # freed: it imports again
    ok(a, "rt.free_physical", ok(a, imp, s, FABRIC, 0))  # the exporter imports its own handle
    eventually(lambda: served_nothing(shared_fabric), "remote holds left behind")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["free", "exit"])
def test_rule_14_the_exporters_free_or_death_revokes_while_remote_importers_keep_the_memory(
        fab: TestCluster, how: str) -> None:
    shared_fabric = fab
    a, b, late = shared_fabric.actor(1), shared_fabric.actor(2), shared_fabric.actor(2)
    imp = "rt.mem_import_from_shareable_handle_v2"
    h, s, ap = export(a, 2 * M2, pids=[b.pid, late.pid])
    a.call("!write", ap, 0x11, 2 * M2)
    ih, rp = import_map(b, s, 2 * M2)
    if how == "free":
        ok(a, "rt.unmap_mem", ap)
        ok(a, "rt.free_physical", h)
    else:
        a.kill()
    assert "revoked" in fails(late, BAD_HANDLE, imp, s, FABRIC, 0)
    buf = ok(b, "rt.malloc_host", 2 * M2)
    ok(b, "rt.memcpy", buf, 2 * M2, rp, 2 * M2, 2)
    assert b.call("!sha256", buf, 2 * M2) == hashlib.sha256(b"\x11" * 2 * M2).hexdigest()
    ok(b, "rt.memset", rp, 2 * M2, 0x22, 2 * M2)  # still writable, and still the same memory
    ok(b, "rt.memcpy", buf, 2 * M2, rp, 2 * M2, 2)
    assert b.call("!sha256", buf, 2 * M2) == hashlib.sha256(b"\x22" * 2 * M2).hexdigest()
    unmap_free(b, ih, rp)
    eventually(lambda: served_nothing(shared_fabric), "the memory is still served after its last importer freed it")
    assert shared_fabric.brokers[1].listing()["used"] == {}


def test_rule_16_forged_and_garbled_handles_are_refused_and_nothing_leaks(fab: TestCluster) -> None:
    shared_fabric = fab
    a, b = shared_fabric.actor(1), shared_fabric.actor(2)
    imp = "rt.mem_import_from_shareable_handle_v2"
    _, s, _ = export(a, flags=NO_PID_CHECK)
    ok(b, "rt.free_physical", ok(b, imp, s, FABRIC, 0))  # the link and both engines are up from here on
    fds = {n: shared_fabric.brokers[n].fd_count() for n in (1, 2)}
    for at, code in ((64, BAD_HANDLE), (95, BAD_HANDLE), (16, BAD_HANDLE), (0, BAD_HANDLE), (32, PARAM),
                     (96, BAD_HANDLE)):
        bad = bytearray(s)
        bad[at] ^= 0x40
        fails(b, code, imp, bytes(bad), FABRIC, 0)
    nowhere = bytearray(s)
    nowhere[34:36] = (1).to_bytes(2, "little")  # the endpoint's port: nobody listens there
    assert "10.77.0.1:1" in fails(b, IPC, imp, bytes(nowhere), FABRIC, 0)
    for cut in (s[:127], s + b"\0", b""):
        fails(b, PARAM, imp, cut, FABRIC, 0)
    ok(b, "rt.free_physical", ok(b, imp, s, FABRIC, 0))  # the real handle still imports
    eventually(lambda: served_nothing(shared_fabric), "remote holds left behind")
    eventually(lambda: all(shared_fabric.brokers[n].fd_count() <= fds[n] for n in (1, 2)), "a broker holds more fds")


def test_without_the_transport_a_remote_handle_says_what_to_configure(fab: TestCluster) -> None:
    shared_fabric = fab
    plain = {"VMMSHARE_FABRIC": "off", "VMMSHARE_SOCKET": str(shared_fabric.root / "plain" / "broker.sock")}
    a, b = shared_fabric.actor(1), shared_fabric.actor(2, **plain)  # b's broker (auto-started) has no transport
    _, s, _ = export(a, flags=NO_PID_CHECK)
    msg = fails(b, NOT_SUPPORTED, "rt.mem_import_from_shareable_handle_v2", s, FABRIC, 0)
    assert "VMMSHARE_FABRIC=tcp" in msg and "cross-server" in msg
    off = shared_fabric.actor(1, VMMSHARE_FABRIC="off", VMMSHARE_SOCKET=str(shared_fabric.root / "off" / "broker.sock"))
    _, t, _ = export(off, flags=NO_PID_CHECK)
    assert t[32:64] == bytes(32)  # no endpoint in the handle
    msg = fails(shared_fabric.actor(2), NOT_SUPPORTED, "rt.mem_import_from_shareable_handle_v2", t, FABRIC, 0)
    assert "no fabric endpoint" in msg and "VMMSHARE_FABRIC" in msg
