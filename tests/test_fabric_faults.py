"""Faults across servers (SPEC §8): a peer broker killed or frozen, a server's link down, an importer or its broker
gone. Each fault gives a clear error naming the peer (507022), never a hang, and nothing stays behind: the
exporting node stops serving memory whose importers are gone, once their lease ends (VMMSHARE_FABRIC_TIMEOUT is 1 s
here, so the lease is 4 s)."""

from __future__ import annotations

import hashlib
import signal

import pytest

from conftest import require
from fabric_cluster import TestCluster, cluster_problem, eventually
from test_fabric_sharing import FABRIC, IPC, M2, export, fails, import_map, ok, served_nothing, unmap_free

require(not cluster_problem(), cluster_problem())

IMP = "rt.mem_import_from_shareable_handle_v2"


@pytest.mark.parametrize("surface", ["python", "c"])
def test_a_killed_exporting_broker_is_a_clear_error_and_frees_cleanly(fabric: TestCluster, surface: str) -> None:
    """The importers are Python programs, or C ones (the C library through `cacl`)."""
    fabric.surfaces = {2: surface}
    a, b, c = fabric.actor(1), fabric.actor(2), fabric.actor(2)
    _, s, _ = export(a, pids=[b.pid, c.pid])
    ih, rp = import_map(b, s)
    buf = ok(b, "rt.malloc_host", 4096)
    ok(b, "rt.memcpy", buf, 4096, rp, 4096, 2)
    fabric.brokers[1].signal(signal.SIGKILL)
    msg = fails(b, IPC, "rt.memcpy", buf, 4096, rp, 4096, 2)
    assert "10.77.0.1" in msg
    fails(b, IPC, "rt.memset", rp, 16, 0, 16)
    msg = fails(c, IPC, IMP, s, FABRIC, 0)
    assert "10.77.0.1:17017" in msg
    unmap_free(b, ih, rp)  # freeing memory of a server that is gone works, at once
    assert fabric.brokers[2].listing()["exports"] == []


@pytest.mark.slow
def test_a_frozen_exporting_broker_times_out_and_recovers(fabric: TestCluster) -> None:
    a, b, c = fabric.actor(1), fabric.actor(2), fabric.actor(2)
    _, s, ap = export(a, pids=[b.pid, c.pid])
    a.call("!write", ap, 0x33, M2)
    ih, rp = import_map(b, s)
    buf = ok(b, "rt.malloc_host", M2)
    ok(b, "rt.memcpy", buf, M2, rp, M2, 2)
    fabric.brokers[1].signal(signal.SIGSTOP)
    try:
        msg = fails(c, IPC, IMP, s, FABRIC, 0)
        assert "within 1 s" in msg and "VMMSHARE_FABRIC_TIMEOUT" in msg
        fails(b, IPC, "rt.memcpy", buf, M2, rp, M2, 2)
    finally:
        fabric.brokers[1].signal(signal.SIGCONT)
    # thawed within the lease: the importer's broker adopts its hold again, and the memory reads as before
    eventually(lambda: b.call("rt.memcpy", buf, M2, rp, M2, 2) == 0, "the copy does not work again")
    assert b.call("!sha256", buf, M2) == hashlib.sha256(b"\x33" * M2).hexdigest()
    ok(c, "rt.free_physical", ok(c, IMP, s, FABRIC, 0))
    unmap_free(b, ih, rp)
    eventually(lambda: served_nothing(fabric), "the memory is still served")


@pytest.mark.slow
@pytest.mark.parametrize("surface", ["python", "c"])
def test_a_link_down_is_a_clear_error_and_up_again_works(fabric: TestCluster, surface: str) -> None:
    """The importers are Python programs, or C ones (the C library through `cacl`)."""
    fabric.surfaces = {2: surface}
    a, b, c = fabric.actor(1), fabric.actor(2), fabric.actor(2)
    _, s, ap = export(a, pids=[b.pid, c.pid])
    a.call("!write", ap, 0x44, M2)
    ih, rp = import_map(b, s)
    buf = ok(b, "rt.malloc_host", M2)
    fabric.cluster.link(1, up=False)
    try:
        fails(b, IPC, "rt.memcpy", buf, M2, rp, M2, 2)
        msg = fails(c, IPC, IMP, s, FABRIC, 0)
        assert "10.77.0.1" in msg
    finally:
        fabric.cluster.link(1, up=True)
    eventually(lambda: b.call("rt.memcpy", buf, M2, rp, M2, 2) == 0, "the copy does not work again")
    assert b.call("!sha256", buf, M2) == hashlib.sha256(b"\x44" * M2).hexdigest()
    unmap_free(b, ih, rp)
    eventually(lambda: served_nothing(fabric), "the memory is still served")


@pytest.mark.slow
@pytest.mark.parametrize("who", ["importer", "importers broker", "importers server"])
def test_what_an_importer_held_is_released_when_it_or_its_server_goes(fabric: TestCluster, who: str) -> None:
    a, b = fabric.actor(1), fabric.actor(2)
    h, s, ap = export(a, pids=[b.pid])
    import_map(b, s)
    assert fabric.brokers[1].memfd_mappings() == 1
    if who == "importer":
        b.kill()  # its broker sees it go, and releases at once
    elif who == "importers broker":
        fabric.brokers[2].signal(signal.SIGKILL)  # the link goes: released when the lease ends
    else:
        fabric.cluster.link(2, up=False)  # the server drops off the network for good
        fabric.brokers[2].signal(signal.SIGSTOP)
    eventually(lambda: served_nothing(fabric), "the exporting node still serves memory of an importer that is gone")
    ok(a, "rt.unmap_mem", ap)
    ok(a, "rt.free_physical", h)
    assert fabric.brokers[1].listing()["exports"] == []


@pytest.mark.slow
@pytest.mark.parametrize("surface", ["python", "c"])
def test_after_its_broker_restarts_a_process_imports_and_copies_again(fabric: TestCluster, surface: str) -> None:
    """The importing broker restarts under a process that imported: the process's next remote import comes with a
    new metadata namespace (the new broker's service), and its copies use an engine started there (a Python
    importer's), or reach the exporting engine again (a C importer's)."""
    a, b = fabric.actor(1), fabric.actor(2, VMMSHARE_ACTOR_SURFACE=surface)
    _, s, ap = export(a, pids=[b.pid])
    a.call("!write", ap, 0x33, M2)
    h, rp = import_map(b, s)
    buf = ok(b, "rt.malloc_host", M2)
    ok(b, "rt.memcpy", buf, M2, rp, M2, 2)
    fabric.brokers[2].signal(signal.SIGKILL)
    fabric.brokers[2].start()
    unmap_free(b, h, rp)  # that import went with the broker (the exporter's hold waits on its lease)
    h, rp = import_map(b, s)
    ok(b, "rt.memcpy", buf, M2, rp, M2, 2)
    assert b.call("!sha256", buf, M2) == hashlib.sha256(b"\x33" * M2).hexdigest()
    unmap_free(b, h, rp)
    eventually(lambda: served_nothing(fabric), "the memory is still served")
