"""HOST_NUMA (location type 4): host memory bound to a NUMA node of this machine, for every process that maps it.

This machine may have one node. Node 0 is bound for real and checked in /proc/<pid>/numa_maps (in this process and
in an importer); a second node is tested through a fake sysfs tree that lists it: the runtime then asks the kernel
to bind to a node it does not have, and that must fail cleanly (107000, nothing left behind).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from conftest import G2M, NO_CONTEXT, NOT_SUPPORTED, PARAM, MiB, child_ok, expect_fail, fd_count, memfds, ok, prop
from vmmshare._process import runtime
from vmmshare.backends import host

HOST_NUMA = 4


def numa_policy(addr: int, pid: str = "self") -> str:
    """The numa_maps line of the VMA at `addr` (its policy, then the pages per node)."""
    with open(f"/proc/{pid}/numa_maps") as f:
        for line in f:
            if int(line.split()[0], 16) == addr:
                return line
    raise AssertionError(f"no VMA at {addr:#x} in numa_maps")


@pytest.fixture
def fake_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Point the runtime's node list at a fake sysfs tree; returns a function writing its `online` file."""

    def write(text: str) -> None:
        (tmp_path / "online").write_text(text)

    monkeypatch.setattr(host, "NUMA_SYSFS", str(tmp_path))
    return write


def test_numa_nodes_reads_the_kernels_list(fake_nodes, tmp_path: Path):
    fake_nodes("0\n")
    assert host.numa_nodes() == [0]
    fake_nodes("0-3,6\n")
    assert host.numa_nodes() == [0, 1, 2, 3, 6]
    fake_nodes("garbage")
    assert host.numa_nodes() == [0]
    os.unlink(tmp_path / "online")
    assert host.numa_nodes() == [0], "a kernel without NUMA has one node: 0"
    assert host.numa_nodes("/sys/devices/system/node")[0] == 0


def test_host_numa_memory_is_bound_to_its_node(vmm):
    """Node 0 (every machine has it): the pages are bound there, as numa_maps shows after they are touched."""
    p, h = vmm.mapped(4 * MiB, attr=12, loc_type=HOST_NUMA)
    ctypes.memset(p, 1, 4 * MiB)
    line = numa_policy(p)
    assert "bind:0" in line and "N0=" in line, line
    assert ok(vmm.rt.mem_get_allocation_properties_from_handle(h))["location"] == {"id": 0, "type": HOST_NUMA}
    q, _ = vmm.mapped(G2M, attr=12, loc_type=0)  # plain host memory has no binding
    ctypes.memset(q, 1, G2M)
    assert "bind:" not in numa_policy(q)


def test_the_binding_travels_with_the_memory_to_an_importer():
    """The policy is the memfd's own: a process that imports and maps it gets pages on the node too."""
    code = """
    import ctypes, subprocess, sys
    ok(acl.rt.set_device(0))
    h = ok(acl.rt.malloc_physical(2 * M, P(attr=13, t=4), 0))
    sh = ok(acl.rt.mem_export_to_shareable_handle_v2(h, 1, 1))
    child = subprocess.run([sys.executable, "-c", '''
import ctypes, sys
import vmmshare.acl as acl
assert acl.rt.set_device(0) == 0
h, ret = acl.rt.mem_import_from_shareable_handle_v2(int(sys.argv[1]), 1, 0)
assert ret == 0, acl.get_recent_err_msg()
p, _ = acl.rt.reserve_mem_address(2 << 20, 0, 0, 0)
assert acl.rt.map_mem(p, 2 << 20, 0, h, 0) == 0
ctypes.memset(p, 3, 2 << 20)
print([line for line in open("/proc/self/numa_maps") if int(line.split()[0], 16) == p][0])
'''.strip(), str(sh)], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert "bind:0" in child.stdout and "N0=" in child.stdout, child.stdout
    ok(acl.rt.free_physical(h))
    """
    child_ok(code)


def test_a_node_that_does_not_exist_is_107000_naming_the_nodes(acl):
    nodes = host.numa_nodes()
    missing = max(nodes) + 1
    for node in (missing, 255, 0xFFFFFFFF):
        msg = expect_fail(PARAM, acl.rt.malloc_physical, G2M, prop(dev=node, loc_type=HOST_NUMA), 0)
        assert f"NUMA node {node} does not exist" in msg and ", ".join(map(str, nodes)) in msg, msg
    expect_fail(PARAM, acl.rt.mem_get_allocation_granularity, prop(dev=missing, loc_type=HOST_NUMA), 0)
    expect_fail(PARAM, acl.rt.malloc_physical, G2M, prop(dev=-1, loc_type=HOST_NUMA), 0)


def test_a_listed_node_the_kernel_will_not_bind_fails_cleanly(acl, fake_nodes):
    """A second node: the (fake) sysfs tree lists nodes 0 and 1, so node 1 passes the runtime's check; this
    machine's kernel has no node 1, so mbind refuses it: 107000 with the kernel's reason, and no memfd, mapping,
    table entry or capacity is left behind."""
    if host.numa_nodes("/sys/devices/system/node") != [0]:
        pytest.skip("this machine has a second NUMA node: the real one is tested instead")
    fake_nodes("0-1\n")
    assert host.numa_nodes() == [0, 1]
    rt = runtime()
    fds, mfds, counts = fd_count(), memfds(), rt.counts()
    free_before = acl.rt.get_mem_info(0)
    for _ in range(3):
        msg = expect_fail(PARAM, acl.rt.malloc_physical, G2M, prop(dev=1, loc_type=HOST_NUMA), 0)
        assert "NUMA node 1" in msg and "Invalid argument" in msg, msg
    assert fd_count() == fds and memfds() == mfds and rt.counts() == counts
    assert acl.rt.get_mem_info(0) == free_before
    assert ok(acl.rt.mem_get_allocation_granularity(prop(dev=1, loc_type=HOST_NUMA), 0)) == G2M


def test_binding_to_a_nonexistent_node_fails_in_the_kernel_with_nothing_mapped():
    """bind_numa itself: the kernel refuses a node it does not have, and the temporary mapping is gone."""
    mem = host.allocate(G2M)
    try:
        before = Path("/proc/self/maps").read_text().count("memfd:vmmshare")
        with pytest.raises(OSError):
            host.bind_numa(mem.fd, G2M, max(host.numa_nodes()) + 1)
        with pytest.raises(OSError):
            host.bind_numa(mem.fd, G2M, 1 << 20)  # beyond any node mask
        assert Path("/proc/self/maps").read_text().count("memfd:vmmshare") == before
        host.bind_numa(mem.fd, G2M, 0)
    finally:
        mem.close()


def test_host_numa_needs_a_current_context(acl):
    """The runtime places NUMA memory for the current context (107002 without one); the granularity does not."""
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(acl.rt.malloc_physical(G2M, prop(loc_type=HOST_NUMA), 0)))
    t.start()
    t.join()
    assert out == [(0, NO_CONTEXT)]


def test_1gib_pages_are_not_host_numa_memory(acl):
    expect_fail(NOT_SUPPORTED, acl.rt.malloc_physical, 1 << 30, prop(14, loc_type=HOST_NUMA), 0)


def test_pythonic_numa_node(vmm):
    import vmmshare

    with vmmshare.Device(0).allocate(G2M, attr=13, location="host", numa_node=0) as mem, mem.map() as m:
        assert mem.numa_node == 0 and mem.properties["location"] == {"id": 0, "type": HOST_NUMA}
        view = m.numpy()
        view[:] = 9
        del view
        assert "bind:0" in numa_policy(m.ptr)
    with pytest.raises(vmmshare.InvalidParamError):
        vmmshare.Device(0).allocate(G2M, location="host", numa_node=max(host.numa_nodes()) + 1)
    with pytest.raises(vmmshare.InvalidParamError):
        vmmshare.Device(0).allocate(G2M, location="device", numa_node=0)
