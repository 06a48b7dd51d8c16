"""The IPC memory API (aclrtIpcMem*; reference/cann-api-ipc-memory-sharing.md) between real processes, on the
broker's exports, trustlists and revocation, as the VMM handles: keys of aclrtMalloc memory, the trustlist, import
and close in the importer and the exporter, and the runtime's checks and codes."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import procs
from procs import Actor, BrokerProc, clean_env, ok

fails = functools.partial(procs.fails, neutral=(0, None, ""))  # the IPC calls' failed outputs: 0, None or ""

ACL_PARAM = 100000
PARAM = 107000
NO_CONTEXT = 107002
BAD_HANDLE = 107017
NOT_SUPPORTED = 207000
NO_PERMISSION = 207006
SERVER_ID = 0x5EED_0002
NO_PID_CHECK = 1
MiB2 = 2 << 20
SIZE = 3 << 20  # not a multiple of the page size: the block behind it is 4 MiB

MakeActor = Callable[..., Actor]


@pytest.fixture(scope="module")
def broker_env() -> dict[str, str]:
    """The tests' broker (conftest's `broker`, one for the module) and its clients have SERVER_ID."""
    return clean_env(VMMSHARE_SERVER_ID=hex(SERVER_ID))


@pytest.fixture(params=["python", "c"])
def actor(broker: BrokerProc, request: pytest.FixtureRequest) -> Iterator[MakeActor]:
    """Actors on this test's broker, on each surface in turn: vmmshare.acl, and the C library through `cacl`."""
    made: list[Actor] = []

    def make(device: int | None = 0, **env_over: str) -> Actor:
        a = Actor({**broker.env, "VMMSHARE_ACTOR_SURFACE": request.param, **env_over}, device=device)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


def exported(e: Actor, flags: int = 0, pids: list[int] | None = None) -> tuple[int, str]:
    """acl.rt.malloc memory in `e`, filled with a pattern, and its IPC key (with `pids` trusted)."""
    p = ok(e, "rt.malloc", SIZE, 0)
    e.call("!write", p, 0x5A, SIZE)
    e.call("!write_bytes", p + 4096, b"ipc memory")
    key = ok(e, "rt.ipc_mem_get_export_key", p, SIZE, 65, flags)
    assert isinstance(key, str) and len(key) < 65
    if pids:
        ok(e, "rt.ipc_mem_set_import_pid", key, pids)
    return p, key


def same_bytes(a: Actor, pa: int, b: Actor, pb: int, size: int = SIZE) -> bool:
    return bool(a.call("!sha256", pa, size) == b.call("!sha256", pb, size))


# ---------------------------------------------------------------- the sample flow


def test_the_ipc_flow_of_the_reference(actor: MakeActor) -> None:
    """A: malloc, get_export_key, (B's bare tgid on the trustlist); B: import_by_key, use, close; A: close, free.
    Both see the same bytes, written by either."""
    a, b = actor(), actor()
    tgid = ok(b, "rt.device_get_bare_tgid")
    p, key = exported(a, pids=[tgid])
    q = ok(b, "rt.ipc_mem_import_by_key", key, 0)
    assert b.call("!read", q + 4096, 10) == b"ipc memory"
    assert same_bytes(a, p, b, q)
    b.call("!write_bytes", q, b"written by the importer")
    assert a.call("!read", p, 23) == b"written by the importer"
    assert ok(b, "rt.mem_get_address_range", q) == (q, 4 << 20)  # the whole block, mapped at a pointer of its own
    ok(b, "rt.ipc_mem_close", key)
    fails(b, PARAM, "rt.mem_get_address_range", q)  # unmapped
    ok(a, "rt.ipc_mem_close", key)
    ok(a, "rt.free", p)


def test_the_trustlist(actor: MakeActor) -> None:
    a, b, c = actor(), actor(), actor()
    _, key = exported(a, pids=[b.pid])
    msg = fails(c, NO_PERMISSION, "rt.ipc_mem_import_by_key", key, 0)
    assert "trustlist" in msg
    fails(c, NO_PERMISSION, "rt.ipc_mem_set_import_pid", key, [c.pid])  # only the exporter sets it
    ok(b, "rt.ipc_mem_import_by_key", key, 0)
    ok(a, "rt.ipc_mem_set_import_pid", key, [c.pid])  # calls add to it
    ok(c, "rt.ipc_mem_import_by_key", key, 1)  # ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS


def test_without_pid_validation_anyone_imports_and_there_is_no_trustlist(actor: MakeActor) -> None:
    a, b = actor(), actor()
    p, key = exported(a, flags=NO_PID_CHECK)
    q = ok(b, "rt.ipc_mem_import_by_key", key, 0)
    assert same_bytes(a, p, b, q)
    msg = fails(a, NO_PERMISSION, "rt.ipc_mem_set_import_pid", key, [b.pid])
    assert "DISABLE_PID_VALIDATION" in msg


@pytest.mark.parametrize("flags", [0, NO_PID_CHECK], ids=["pid-validation", "no-pid-validation"])
def test_rule_13_the_creator_imports_its_own_key(actor: MakeActor, flags: int) -> None:
    """As the runtime lets it (its IpcOpenMemory has no owner check): the exporter's import maps the memory at a
    pointer of its own, without a trustlist entry; its first close drops that import, the next one revokes the
    key; then the key is gone for everyone, the exporter too."""
    a, b = actor(), actor()
    p, key = exported(a, flags=flags)
    q = ok(a, "rt.ipc_mem_import_by_key", key, 0)
    assert q != p and same_bytes(a, p, a, q)
    a.call("!write_bytes", q, b"through the import")
    assert a.call("!read", p, 18) == b"through the import"
    assert ok(a, "rt.ipc_mem_import_by_key", key, 0) == q  # again: the same pointer
    if flags == 0:
        fails(b, NO_PERMISSION, "rt.ipc_mem_import_by_key", key, 0)  # the trustlist still governs others
    ok(a, "rt.ipc_mem_close", key)
    ok(a, "rt.ipc_mem_close", key)  # the import goes at its last close
    fails(a, PARAM, "rt.mem_get_address_range", q)
    ok(a, "rt.ipc_mem_close", key)  # the exporter's close: revoked
    fails(a, BAD_HANDLE, "rt.ipc_mem_import_by_key", key, 0)
    ok(a, "rt.free", p)


def test_importing_a_key_twice_gives_the_same_pointer_and_each_close_takes_one(actor: MakeActor) -> None:
    a, b = actor(), actor()
    _, key = exported(a, pids=[b.pid])
    q1 = ok(b, "rt.ipc_mem_import_by_key", key, 0)
    q2 = ok(b, "rt.ipc_mem_import_by_key", key, 0)
    assert q1 == q2
    ok(b, "rt.ipc_mem_close", key)
    assert b.call("!read", q1 + 4096, 3) == b"ipc"  # still mapped: one import left
    ok(b, "rt.ipc_mem_close", key)
    fails(b, PARAM, "rt.mem_get_address_range", q1)
    fails(b, BAD_HANDLE, "rt.ipc_mem_close", key)
    q3 = ok(b, "rt.ipc_mem_import_by_key", key, 0)  # and again, as new
    assert b.call("!read", q3 + 4096, 3) == b"ipc"


def test_the_exporters_close_revokes_the_key_and_importers_keep_their_memory(actor: MakeActor) -> None:
    a, b, c = actor(), actor(), actor()
    p, key = exported(a, pids=[b.pid, c.pid])
    q = ok(b, "rt.ipc_mem_import_by_key", key, 0)
    ok(a, "rt.ipc_mem_close", key)
    fails(c, BAD_HANDLE, "rt.ipc_mem_import_by_key", key, 0)
    fails(b, BAD_HANDLE, "rt.ipc_mem_import_by_key", key, 0)  # importing again asks again: the key is revoked
    assert same_bytes(a, p, b, q), "the importer keeps the memory; the exporter still has it too"
    b.call("!write_bytes", q, b"after the close")
    assert a.call("!read", p, 15) == b"after the close"
    msg = fails(a, PARAM, "rt.ipc_mem_get_export_key", p, SIZE, 65, 0)
    assert "exports once" in msg
    fails(a, BAD_HANDLE, "rt.ipc_mem_close", key)  # closed already
    ok(a, "rt.free", p)
    assert b.call("!read", q + 4096, 10) == b"ipc memory"
    ok(b, "rt.ipc_mem_close", key)


@pytest.mark.parametrize("how", ["free", "exit"])
def test_freeing_or_dying_revokes_and_importers_keep_their_memory(actor: MakeActor, how: str) -> None:
    a, b, c = actor(), actor(), actor()
    p, key = exported(a, pids=[b.pid, c.pid])
    q = ok(b, "rt.ipc_mem_import_by_key", key, 0)
    digest = b.call("!sha256", q, SIZE)
    if how == "free":
        ok(a, "rt.free", p)
    else:
        a.kill()
    fails(c, BAD_HANDLE, "rt.ipc_mem_import_by_key", key, 0)
    fails(b, BAD_HANDLE, "rt.ipc_mem_import_by_key", key, 0)
    assert b.call("!sha256", q, SIZE) == digest
    ok(b, "rt.ipc_mem_close", key)


def test_export_twice_gives_the_same_key(actor: MakeActor) -> None:
    a, b, c = actor(), actor(), actor()
    p, key = exported(a, pids=[b.pid])
    assert ok(a, "rt.ipc_mem_get_export_key", p, 4096, 100, 0) == key
    msg = fails(a, PARAM, "rt.ipc_mem_get_export_key", p, SIZE, 65, NO_PID_CHECK)
    assert "pid validation on" in msg
    ok(a, "rt.ipc_mem_close", key)  # one of the two exports taken back: still importable
    ok(b, "rt.ipc_mem_import_by_key", key, 0)
    ok(a, "rt.ipc_mem_close", key)  # the last: revoked
    fails(c, BAD_HANDLE, "rt.ipc_mem_import_by_key", key, 0)


def test_what_can_be_exported(actor: MakeActor) -> None:
    """Only the start of acl.rt.malloc memory, for a size inside it; the runtime's argument checks in order."""
    a = actor()
    p = ok(a, "rt.malloc", SIZE, 0)
    prop = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
    h = ok(a, "rt.malloc_physical", MiB2, prop, 0)
    v = ok(a, "rt.reserve_mem_address", MiB2, 0, 0, 0)
    ok(a, "rt.map_mem", v, MiB2, 0, h, 0)
    get = "rt.ipc_mem_get_export_key"
    fails(a, PARAM, get, 0, 0, 1024, 9)  # pyACL's bound on len comes first
    fails(a, ACL_PARAM, get, 0, 0, 0, 9)  # devPtr NULL: the acl layer's
    fails(a, ACL_PARAM, get, None, SIZE, 65, 0)
    fails(a, PARAM, get, p, 0, 65, 0)  # size 0
    fails(a, PARAM, get, p, SIZE, 0, 0)  # len 0
    fails(a, PARAM, get, p, SIZE, 65, 2)  # flags
    msg = fails(a, PARAM, get, p, SIZE, 64, 0)
    assert "65" in msg  # the runtime's key buffer
    fails(a, PARAM, get, p + 4096, 4096, 65, 0)
    fails(a, PARAM, get, p, (4 << 20) + 1, 65, 0)  # beyond the block
    fails(a, PARAM, get, v, MiB2, 65, 0)  # VMM memory exports by handle, not by key
    fails(a, PARAM, get, 0x7000_0000, 4096, 65, 0)
    b = actor(device=None)
    fails(b, NO_CONTEXT, get, p, SIZE, 65, 0)
    key = ok(a, get, p, SIZE, 65, 0)
    ok(a, "rt.ipc_mem_close", key)


def test_keys_that_are_not_keys(actor: MakeActor) -> None:
    a, b = actor(), actor()
    _, key = exported(a, pids=[b.pid])
    imp = "rt.ipc_mem_import_by_key"
    for bad in ("", "aaa", key.upper(), key + "0", key[:-1], " " + key, "x" * 70, "0" * 24):
        msg = fails(b, PARAM, imp, bad, 0)
        assert "not an IPC memory key" in msg
    fails(b, PARAM, imp, 5, 0)  # not a str
    fails(b, ACL_PARAM, imp, None, 0)
    fails(b, PARAM, imp, key, 2)  # flags
    unknown = f"{int.from_bytes(os.urandom(8), 'little') | 1:016x}{SERVER_ID:08x}"
    fails(b, BAD_HANDLE, imp, unknown, 0)
    msg = fails(b, NOT_SUPPORTED, imp, key[:16] + "00001234", 0)  # made on another server
    assert "cross-server transport" in msg
    fails(b, ACL_PARAM, "rt.ipc_mem_close", None)
    fails(b, BAD_HANDLE, "rt.ipc_mem_close", unknown)
    fails(b, PARAM, "rt.ipc_mem_close", "aaa")
    c = actor(device=None)
    fails(c, NO_CONTEXT, imp, key, 0)
    ok(b, imp, key, 0)


def test_set_import_pid_checks(actor: MakeActor) -> None:
    a, b = actor(), actor()
    _, key = exported(a)
    sip = "rt.ipc_mem_set_import_pid"
    fails(a, ACL_PARAM, sip, None, None)
    fails(a, ACL_PARAM, sip, key, None)
    fails(a, PARAM, sip, key, [])  # num 0: the runtime's
    fails(a, PARAM, sip, key, list(range(1, 33)))  # at most 31 per call
    for bad in ([0], [-1], [1 << 31], ["1"], 5):
        fails(a, PARAM, sip, key, bad)
    ok(a, sip, key, list(range(100, 131)))
    ok(a, sip, key, [b.pid])
    ok(b, "rt.ipc_mem_import_by_key", key, 0)


def test_import_pid_inter_server(actor: MakeActor) -> None:
    """Pids of this server are trusted as set_import_pid does; any other server's need the cross-server transport
    (207000), and then nothing of the call takes effect."""
    a, b = actor(), actor()
    _, key = exported(a)
    ips = "rt.ipc_mem_import_pid_inter_server"
    for bad in ([], None, [{"sdid": SERVER_ID, "pid": None}], [{"sdid": SERVER_ID}], [{"pid": [1]}],
                [{"sdid": -1, "pid": [1]}], [{"sdid": SERVER_ID, "pid": list(range(1, 33))}], [5]):
        fails(a, PARAM, ips, key, bad)
    fails(a, PARAM, ips, None, [{"sdid": SERVER_ID, "pid": [b.pid]}])  # no acl-layer checks here: 107000
    msg = fails(a, NOT_SUPPORTED, ips, key, [{"sdid": SERVER_ID, "pid": [b.pid]}, {"sdid": 0x1234, "pid": [7]}])
    assert "0x1234" in msg and "cross-server transport" in msg
    fails(b, NO_PERMISSION, "rt.ipc_mem_import_by_key", key, 0)  # the local entry did not take effect either
    ok(a, ips, key, [{"sdid": SERVER_ID, "pid": [b.pid]}])
    ok(b, "rt.ipc_mem_import_by_key", key, 0)


def test_set_attr(actor: MakeActor) -> None:
    a, b = actor(), actor()
    _, key = exported(a, pids=[b.pid])
    for link in range(4):  # SIO, HCCS, UB_ONE_PORT_PATH, UB_MULTI_PORT_PATH
        ok(b, "rt.ipc_mem_set_attr", key, 0, link)
    fails(b, PARAM, "rt.ipc_mem_set_attr", key, 1, 0)  # the only type: ACL_RT_IPC_MEM_ATTR_ACCESS_LINK
    fails(b, PARAM, "rt.ipc_mem_set_attr", key, 0, 4)
    fails(b, PARAM, "rt.ipc_mem_set_attr", None, 0, 0)  # no acl-layer checks here
    fails(b, PARAM, "rt.ipc_mem_set_attr", "aaa", 0, 0)
    ok(b, "rt.ipc_mem_close", key)  # only an attribute set: forgotten
    fails(b, BAD_HANDLE, "rt.ipc_mem_close", key)
    ok(b, "rt.ipc_mem_set_attr", key, 0, 1)
    q = ok(b, "rt.ipc_mem_import_by_key", key, 0)
    ok(b, "rt.ipc_mem_close", key)  # the import (and the attribute) go
    fails(b, PARAM, "rt.mem_get_address_range", q)


def test_a_key_is_the_brokers_export_like_a_vmm_handle(actor: MakeActor) -> None:
    """The key names the node's DEFAULT handle of the memory: a process may import it by either API."""
    a, b, c = actor(), actor(), actor()
    p, key = exported(a, flags=NO_PID_CHECK)
    h = ok(c, "rt.mem_import_from_shareable_handle", int(key[:16], 16), 0)
    v = ok(c, "rt.reserve_mem_address", 4 << 20, 0, 0, 0)
    ok(c, "rt.map_mem", v, 4 << 20, 0, h, 0)
    q = ok(b, "rt.ipc_mem_import_by_key", key, 0)
    assert same_bytes(a, p, b, q) and same_bytes(b, q, c, v)
    r = ok(c, "rt.ipc_mem_import_by_key", key, 0)  # by the other API too: a pointer of its own (rule 13)
    assert r != v and same_bytes(c, r, c, v)
    ok(c, "rt.ipc_mem_close", key)
    ok(c, "rt.free_physical", h)
    assert c.call("!read", v + 4096, 3) == b"ipc"  # the VMM import's mapping keeps its memory


def test_the_pythonic_api_shares_in_one_call(tmp_path: Path, broker: BrokerProc) -> None:
    importer = textwrap.dedent("""
        import sys, vmmshare
        print(vmmshare.acl.rt.device_get_bare_tgid()[0], flush=True)
        with vmmshare.ipc_open(sys.stdin.readline().strip()) as mem:
            view = mem.numpy("uint32", shape=(4,))
            print(view.tolist(), mem.size, flush=True)
            view[0] = 99
            del view
    """)
    exporter = textwrap.dedent("""
        import subprocess, sys, vmmshare
        with vmmshare.DeviceBuffer(1000) as buf:
            view = buf.numpy("uint32")
            view[:] = 7
            del view
            child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            key = buf.ipc_export(pids=[int(child.stdout.readline())])
            child.stdin.write(key + "\\n")
            child.stdin.flush()
            print(child.stdout.readline().strip(), child.wait(), buf.numpy("uint32", shape=(1,)).tolist())
            buf.ipc_close()
    """)
    out = subprocess.run([sys.executable, "-c", exporter, importer], env=broker.env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[7,", "7,", "7,", "7]", str(2 << 20), "0", "[99]"], out.stdout
