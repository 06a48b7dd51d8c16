"""A FABRIC handle whose size field was altered is not the handle that was exported: rule 16,
107017 and nothing held, through the Pythonic and the pyACL import; refused by the cross-server transport too."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

import vmmshare
from conftest import child_ok, require
from vmmshare.wire.handles import decode_fabric

MiB = 1 << 20
FABRIC = 2
BAD_HANDLE = 107017
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}


def resized(raw: bytes, size: int) -> bytes:
    return dataclasses.replace(decode_fabric(raw), size=size).pack()


def test_rule_16_a_fabric_handle_with_an_altered_size_is_refused_by_a_process_that_imported_the_true_one() -> None:
    """Rule 13's re-import in one process returns the handle it holds, once the broker admits the import again; a
    handle whose size field was altered is still not the handle that was exported (107017), whether or not the
    process holds an import of the true one, and the reference it would have added is not left behind."""
    mem = vmmshare.Device(0).allocate(4 * MiB)
    raw = bytes(mem.export("fabric", validate_pids=False))
    bad = resized(raw, 2 * MiB)
    child_ok(f"""
bad, good = bytes.fromhex('{bad.hex()}'), bytes.fromhex('{raw.hex()}')
acl.rt.set_device(0)
h, ret = acl.rt.mem_import_from_shareable_handle_v2(good, {FABRIC}, 0)
assert ret == 0, acl.get_recent_err_msg()
counts = runtime().counts()
again, ret = acl.rt.mem_import_from_shareable_handle_v2(bad, {FABRIC}, 0)
assert ret == {BAD_HANDLE} and "does not match" in acl.get_recent_err_msg(), (ret, again, acl.get_recent_err_msg())
assert runtime().counts() == counts
assert acl.rt.free_physical(h) == 0
assert acl.rt.free_physical(h) != 0, "the altered import added a reference"
""", env={"VMMSHARE_SOCKET": os.environ["VMMSHARE_SOCKET"]})
    mem.close()


@pytest.mark.parametrize("factor", [2, 0.5, 0])
def test_rule_16_a_fabric_handle_with_an_altered_size_is_refused_locally(factor: float) -> None:
    """Another process imports the altered handle (Pythonic and pyACL): 107017 naming the mismatch, no fd, hold
    or table entry left; the true handle still imports afterwards."""
    mem = vmmshare.Device(0).allocate(4 * MiB)
    raw = bytes(mem.export("fabric", validate_pids=False))
    bad = resized(raw, int(4 * MiB * factor))
    child_ok(f"""
import vmmshare
def fds(): return len(os.listdir('/proc/self/fd'))
bad, good = bytes.fromhex('{bad.hex()}'), bytes.fromhex('{raw.hex()}')
acl.rt.set_device(0)
try:  # the broker connection is opened by the first call: count from after it
    vmmshare.import_handle(bad)
    raise SystemExit("the altered handle imported")
except vmmshare.InvalidHandleError as exc:
    assert exc.code == {BAD_HANDLE} and "does not match what was exported" in exc.message, exc
before, counts = fds(), runtime().counts()
h, ret = acl.rt.mem_import_from_shareable_handle_v2(bad, {FABRIC}, 0)
assert ret == {BAD_HANDLE} and "does not match" in acl.get_recent_err_msg(), (ret, acl.get_recent_err_msg())
assert fds() == before and runtime().counts() == counts
with vmmshare.import_handle(good) as mem:
    assert mem.size == {4 * MiB}
""", env={"VMMSHARE_SOCKET": os.environ["VMMSHARE_SOCKET"]})  # this process's broker, where the export is
    mem.close()


@pytest.mark.slow
def test_rule_16_a_fabric_handle_with_an_altered_size_is_refused_across_servers(request: pytest.FixtureRequest) -> None:
    """The importer's broker asks the exporter's for the memory (SPEC §8) and refuses an answer whose size is not
    the handle's with 107017 (it does not match what was exported), giving the remote hold back."""
    from fabric_cluster import cluster_problem, eventually

    require(not cluster_problem(), cluster_problem())  # namespaces and the transfer engine (CI has both)
    fabric = request.getfixturevalue("fabric")
    a, b = fabric.actor(1), fabric.actor(2)

    def ok(actor: Any, name: str, *args: Any) -> Any:
        result = actor.call(name, *args)
        assert result[-1] == 0, (name, result, actor.last_err)
        return result[0]

    h = ok(a, "rt.malloc_physical", 2 * MiB, PROP, 0)
    s = ok(a, "rt.mem_export_to_shareable_handle_v2", h, 1, FABRIC)  # without pid validation
    for size in (4 * MiB, MiB):
        result = b.call("rt.mem_import_from_shareable_handle_v2", resized(s, size), FABRIC, 0)
        assert result[-1] == BAD_HANDLE and "does not match what was exported" in b.last_err, result

    def served_nothing() -> bool:
        rows = fabric.brokers[1].listing()["exports"]
        return fabric.brokers[1].memfd_mappings() == 0 and not any(r.get("remote_importers") for r in rows)

    eventually(served_nothing, "the refused imports' remote holds are given back")
    imported = ok(b, "rt.mem_import_from_shareable_handle_v2", s, FABRIC, 0)
    assert b.call("rt.free_physical", imported) == 0
    assert a.call("rt.free_physical", h) == 0
