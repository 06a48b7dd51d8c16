"""SPEC §4 rules 9–17 (sharing) and the §6 FABRIC layout, with real processes and a real broker.

The tests share one broker on a temporary socket (conftest's `broker`), which each must leave as it found it; the
exporter and importers are separate Python processes (`procs.Actor`) that run `vmmshare.acl` calls. Nothing is
mocked and nothing waits on time: each step waits for the actor's reply, which comes after the broker answered it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import cannot_run, require
from procs import PROP, Actor, ActorDied, BrokerProc, MiB2, clean_env, fails, host_children, ok, refusal

ACL_PARAM = 100000  # the acl layer's own checks (SPEC §4a)
PARAM = 107000
BAD_DEVICE = 107001
BAD_HANDLE = 107017
NOT_SUPPORTED = 207000
NO_PERMISSION = 207006

DEFAULT, FABRIC = 1, 2
NO_PID_CHECK = 1
SERVER_ID = 0x5EED_0001  # the node's server id in these tests (broker and clients agree)
OTHER_SERVER = "0x1234"

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")

MakeActor = Callable[..., Actor]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def broker_env() -> dict[str, str]:
    """The tests' broker (conftest's `broker`, one for the module) and its clients have SERVER_ID."""
    return clean_env(VMMSHARE_SERVER_ID=hex(SERVER_ID))


@pytest.fixture(params=["python", "c"])
def surface(request: pytest.FixtureRequest) -> str:
    """Each rule runs on both surfaces: vmmshare.acl, and the C library (libascendcl.so) through `cacl`."""
    return str(request.param)


@pytest.fixture
def actor(broker: BrokerProc, surface: str) -> Iterator[MakeActor]:
    """`actor(**env_overrides, prefix=..., device=...)` starts an Actor on this test's broker, on the test's
    surface."""
    made: list[Actor] = []

    def make(prefix: list[str] | None = None, device: int | None = 0, **env_over: str) -> Actor:
        env = dict(broker.env)
        env["VMMSHARE_ACTOR_SURFACE"] = surface
        env.update(env_over)
        a = Actor(env, prefix=prefix, device=device)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()


# ---------------------------------------------------------------- helpers


@dataclass
class Shared:
    handle: int  # the exporter's physical handle
    ptr: int  # where the exporter mapped it
    shareable: Any  # int (DEFAULT) or 128 bytes (FABRIC)
    size: int


def alloc_mapped(a: Actor, size: int = MiB2, prop: dict[str, Any] | None = None) -> tuple[int, int]:
    h = ok(a, "rt.malloc_physical", size, prop or PROP, 0)
    p = ok(a, "rt.reserve_mem_address", size, 0, 0, 0)
    ok(a, "rt.map_mem", p, size, 0, h, 0)
    return h, p


def export(
    a: Actor,
    flags: int = 0,
    share_type: int = DEFAULT,
    size: int = MiB2,
    prop: dict[str, Any] | None = None,
    pids: list[int] | None = None,
) -> Shared:
    """Allocate, map, fill with a pattern and export (V2); optionally trustlist `pids`."""
    h, p = alloc_mapped(a, size, prop)
    a.call("!write", p, 0x5A, size)
    a.call("!write_bytes", p + 4096, os.urandom(4096))
    sh = ok(a, "rt.mem_export_to_shareable_handle_v2", h, flags, share_type)
    if share_type == DEFAULT:
        assert isinstance(sh, int) and sh != 0
    else:
        assert isinstance(sh, bytes) and len(sh) == 128
    if pids:
        ok(a, "rt.mem_set_pid_to_shareable_handle_v2", sh, share_type, pids)
    return Shared(h, p, sh, size)


def import_map(a: Actor, s: Shared, share_type: int = DEFAULT) -> tuple[int, int]:
    """Import (V2) and map: (handle, ptr)."""
    h = ok(a, "rt.mem_import_from_shareable_handle_v2", s.shareable, share_type, 0)
    assert isinstance(h, int) and h != 0
    p = ok(a, "rt.reserve_mem_address", s.size, 0, 0, 0)
    ok(a, "rt.map_mem", p, s.size, 0, h, 0)
    return h, p


def check_shared_both_ways(e: Actor, e_ptr: int, i: Actor, i_ptr: int, size: int) -> None:
    assert e.call("!sha256", e_ptr, size) == i.call("!sha256", i_ptr, size)
    a, b = os.urandom(256), os.urandom(256)
    e.call("!write_bytes", e_ptr + size - 256, a)
    assert i.call("!read", i_ptr + size - 256, 256) == a
    i.call("!write_bytes", i_ptr + 8192, b)
    assert e.call("!read", e_ptr + 8192, 256) == b


def mem_free(a: Actor) -> tuple[int, int]:
    free, total = ok(a, "rt.get_mem_info", 0)
    return free, total


def spawn_with_pid(make: MakeActor, target: int, tries: int = 8) -> Actor:
    """Start an Actor whose pid is `target`, by steering the kernel's next pid (ns_last_pid); skip if impossible
    (fail in CI, see conftest.require)."""
    require(os.access(NS_LAST_PID, os.W_OK), f"{NS_LAST_PID} is not writable here: cannot make the kernel reuse a pid")
    for _ in range(tries):
        try:
            NS_LAST_PID.write_text(str(target - 1))
        except OSError as exc:
            cannot_run(f"cannot write {NS_LAST_PID}: {exc}")
        a = make()
        if a.pid == target:
            return a
        a.kill()  # another process forked in between: try again
    cannot_run(f"could not get pid {target} for a new process in {tries} tries (ns_last_pid had no effect, or a "
               "busy machine took the pid first)")


def free_pid() -> int:
    """A pid no process has now, above the recent ones so ordinary forks do not reach it soon."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    last = int(NS_LAST_PID.read_text()) if NS_LAST_PID.exists() else os.getpid()
    for cand in range(last + 5000, last + 15000):
        pid = cand % pid_max
        if pid > 300 and not os.path.exists(f"/proc/{pid}"):
            return pid
    cannot_run(f"no free pid in [{last + 5000}, {last + 15000}) modulo pid_max {pid_max}")


# ---------------------------------------------------------------- data sharing


@pytest.mark.parametrize("share_type", [DEFAULT, FABRIC], ids=["default", "fabric"])
def test_mappings_in_exporter_and_importer_share_bytes_both_ways(actor: MakeActor, share_type: int) -> None:
    e, i = actor(), actor()
    s = export(e, share_type=share_type, pids=[i.pid])
    _, ip = import_map(i, s, share_type)
    check_shared_both_ways(e, s.ptr, i, ip, s.size)


# ---------------------------------------------------------------- rule 9


def test_rule_9_a_handle_exports_once_whatever_the_share_type(actor: MakeActor) -> None:
    e, i = actor(), actor()
    s = export(e, flags=NO_PID_CHECK)
    msg = fails(e, PARAM, "rt.mem_export_to_shareable_handle_v2", s.handle, NO_PID_CHECK, DEFAULT)
    assert "once" in msg or "already" in msg
    fails(e, PARAM, "rt.mem_export_to_shareable_handle_v2", s.handle, 0, FABRIC)
    fails(e, PARAM, "rt.mem_export_to_shareable_handle", s.handle, 0, 0)

    h2, _ = alloc_mapped(e)
    ok(e, "rt.mem_export_to_shareable_handle_v2", h2, 0, FABRIC)
    fails(e, PARAM, "rt.mem_export_to_shareable_handle_v2", h2, 0, DEFAULT)
    fails(e, PARAM, "rt.mem_export_to_shareable_handle_v2", h2, 0, FABRIC)

    h3, _ = alloc_mapped(e)
    sh3 = ok(e, "rt.mem_export_to_shareable_handle", h3, 0, 0)
    assert isinstance(sh3, int) and sh3 != 0
    fails(e, PARAM, "rt.mem_export_to_shareable_handle_v2", h3, 0, DEFAULT)

    # the refused second exports did not disturb the first: it still imports
    _, ip = import_map(i, s)
    check_shared_both_ways(e, s.ptr, i, ip, s.size)


# ---------------------------------------------------------------- rule 10


def test_rule_10_export_flags_and_share_type_are_checked(actor: MakeActor) -> None:
    e, i = actor(), actor()
    h, _ = alloc_mapped(e)
    for flags in (2, 3, 0x100, -1, 1 << 64, "0", None, 1.0):
        fails(e, PARAM, "rt.mem_export_to_shareable_handle_v2", h, flags, DEFAULT)
    for share_type in (0, 3, -1, 0x100000001, "1", None):
        fails(e, PARAM, "rt.mem_export_to_shareable_handle_v2", h, 0, share_type)
    fails(e, PARAM, "rt.mem_export_to_shareable_handle", h, 0, 2)  # V1: flags
    fails(e, ACL_PARAM, "rt.mem_export_to_shareable_handle", h, 1, 0)  # V1: handle type not NONE (the acl layer's)
    fails(e, ACL_PARAM, "rt.mem_export_to_shareable_handle", h, 2, 0)  # POSIX is not NONE either
    # none of the refused calls used up the one export
    sh = ok(e, "rt.mem_export_to_shareable_handle_v2", h, NO_PID_CHECK, DEFAULT)
    ok(i, "rt.mem_import_from_shareable_handle_v2", sh, DEFAULT, 0)


def test_rule_10_an_imported_handle_cannot_be_exported(actor: MakeActor) -> None:
    e, i, j = actor(), actor(), actor()
    s = export(e, flags=NO_PID_CHECK)
    ih = ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    for share_type in (DEFAULT, FABRIC):
        for flags in (0, NO_PID_CHECK):
            fails(i, PARAM, "rt.mem_export_to_shareable_handle_v2", ih, flags, share_type)
    fails(i, PARAM, "rt.mem_export_to_shareable_handle", ih, 0, 0)
    # the same for a FABRIC import
    f = export(e, flags=NO_PID_CHECK, share_type=FABRIC)
    jh = ok(j, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, 0)
    fails(j, PARAM, "rt.mem_export_to_shareable_handle_v2", jh, 0, FABRIC)
    fails(j, PARAM, "rt.mem_export_to_shareable_handle_v2", jh, 0, DEFAULT)


def test_rule_10_unknown_and_freed_handles_do_not_export(actor: MakeActor) -> None:
    e = actor()
    fails(e, BAD_HANDLE, "rt.mem_export_to_shareable_handle_v2", 0x7357_0000_1234, 0, DEFAULT)
    h = ok(e, "rt.malloc_physical", MiB2, PROP, 0)
    ok(e, "rt.free_physical", h)
    fails(e, BAD_HANDLE, "rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
    fails(e, BAD_HANDLE, "rt.mem_export_to_shareable_handle", h, 0, 0)


# ---------------------------------------------------------------- rule 11


def test_rule_11_default_export_imports_only_on_the_trustlist(actor: MakeActor) -> None:
    e, i, stranger = actor(), actor(), actor()
    s = export(e)  # flags 0: pid validation on, empty trustlist
    msg = fails(i, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    assert "trustlist" in msg
    fails(i, NO_PERMISSION, "rt.mem_import_from_shareable_handle", s.shareable, 0)
    ok(e, "rt.mem_set_pid_to_shareable_handle", s.shareable, [i.pid])
    _, ip = import_map(i, s)
    check_shared_both_ways(e, s.ptr, i, ip, s.size)
    # trusting i let in i alone
    fails(stranger, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)


def test_rule_11_disable_pid_validation_lets_anyone_import(actor: MakeActor) -> None:
    e, i, j = actor(), actor(), actor()
    s = export(e, flags=NO_PID_CHECK)
    _, ip = import_map(i, s)
    jh = ok(j, "rt.mem_import_from_shareable_handle", s.shareable, 0)  # V1 import, device 0
    jp = ok(j, "rt.reserve_mem_address", s.size, 0, 0, 0)
    ok(j, "rt.map_mem", jp, s.size, 0, jh, 0)
    digest = e.call("!sha256", s.ptr, s.size)
    assert i.call("!sha256", ip, s.size) == digest == j.call("!sha256", jp, s.size)


# ---------------------------------------------------------------- rule 12


def test_rule_12_only_the_exporter_sets_the_trustlist(actor: MakeActor) -> None:
    e, i, stranger = actor(), actor(), actor()
    s = export(e, pids=[i.pid])
    ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    msg = fails(stranger, NO_PERMISSION, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [stranger.pid])
    assert str(e.pid) in msg or "export" in msg
    fails(stranger, NO_PERMISSION, "rt.mem_set_pid_to_shareable_handle", s.shareable, [stranger.pid])
    fails(i, NO_PERMISSION, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [stranger.pid])
    # the refused calls added nothing
    fails(stranger, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    # FABRIC too
    f = export(e, share_type=FABRIC)
    fails(stranger, NO_PERMISSION, "rt.mem_set_pid_to_shareable_handle_v2", f.shareable, FABRIC, [stranger.pid])
    fails(stranger, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, 0)


def test_rule_12_pids_must_be_positive_32_bit_ints(actor: MakeActor) -> None:
    e, i = actor(), actor()
    s = export(e)
    for bad in (0, -1, -(1 << 31), 1 << 31, 1 << 32, "5", 1.5, None, True):
        fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [bad])
        fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle", s.shareable, [bad])
    # one bad pid spoils the whole call: the good pid next to it is not added
    fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [i.pid, 0])
    fails(i, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    for bad_list in ([], None):  # empty or NULL: the acl layer's checks
        fails(e, ACL_PARAM, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, bad_list)
    for bad_list in (i.pid, "1,2"):  # not a list at all
        fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, bad_list)
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [(1 << 31) - 1, i.pid])
    ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)


def test_rule_12_calls_add_to_the_trustlist(actor: MakeActor) -> None:
    e, i, j = actor(), actor(), actor()
    s = export(e)
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [i.pid])
    ok(e, "rt.mem_set_pid_to_shareable_handle", s.shareable, [j.pid])  # V1 adds to the same list
    ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    ok(j, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)


def test_rule_12_at_most_4096_pids_per_handle(actor: MakeActor) -> None:
    e, i = actor(), actor()
    base = 1 << 30  # far above any pid_max: no such processes
    s = export(e)
    fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, list(range(base, base + 4097)))
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, list(range(base, base + 2000)))
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, list(range(base + 2000, base + 4095)))
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [base, base + 1])  # known: not new
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [i.pid])  # the 4096th
    msg = fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [base + 5000])
    assert "4096" in msg
    fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle", s.shareable, [base + 5001])
    ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)


@pytest.mark.alone  # steers the kernel's next pid (ns_last_pid)
def test_rule_12_a_reused_pid_is_refused(actor: MakeActor) -> None:
    e = actor()
    first = actor()
    pid = first.pid
    s = export(e, pids=[pid])  # bound to `first`'s start time
    first.kill()
    second = spawn_with_pid(actor, pid)
    msg = fails(second, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    assert "reuse" in msg
    # trustlisting the pid again, now that `second` has it, does not rebind it: the entry's process died
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [pid])
    fails(second, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)


@pytest.mark.alone  # steers the kernel's next pid (ns_last_pid)
def test_rule_12_a_pid_trustlisted_before_its_process_exists_is_bound_to_nothing(actor: MakeActor) -> None:
    e = actor()
    target = free_pid()
    s = export(e, pids=[target])
    later = spawn_with_pid(actor, target)
    _, ip = import_map(later, s)
    check_shared_both_ways(e, s.ptr, later, ip, s.size)


# ---------------------------------------------------------------- rule 13


@pytest.mark.parametrize("share_type", [DEFAULT, FABRIC])
@pytest.mark.parametrize("flags", [0, NO_PID_CHECK], ids=["pid-validation", "no-pid-validation"])
def test_rule_13_the_exporter_imports_its_own_handle(actor: MakeActor, share_type: int, flags: int) -> None:
    """HIXL's registration of its own host memory: export, import in the same process, map at a second address.
    The trustlist is for other processes: the exporter needs no entry. Both mappings see the same bytes; each
    handle needs its own free_physical, and the memory stays until the last."""
    e, other = actor(), actor()
    s = export(e, flags=flags, share_type=share_type)
    h = ok(e, "rt.mem_import_from_shareable_handle_v2", s.shareable, share_type, 0)
    assert h != s.handle, "a self-import is a second handle to the memory"
    p = ok(e, "rt.reserve_mem_address", s.size, 0, 0, 0)
    ok(e, "rt.map_mem", p, s.size, 0, h, 0)
    check_shared_both_ways(e, s.ptr, e, p, s.size)
    assert ok(e, "rt.mem_retain_allocation_handle", p) == h
    ok(e, "rt.free_physical", h)  # the retain's reference
    if flags == 0:  # the exporter's own import does not open the handle to anyone else
        fails(other, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", s.shareable, share_type, 0)
    ok(e, "rt.unmap_mem", s.ptr)
    ok(e, "rt.free_physical", s.handle)  # the exporter's handle: revoked for new imports (rule 14) ...
    fails(e, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", s.shareable, share_type, 0)
    e.call("!write_bytes", p, b"still here")  # ... and its own import keeps the memory
    assert e.call("!read", p, 10) == b"still here"
    ok(e, "rt.unmap_mem", p)
    ok(e, "rt.free_physical", h)
    fails(e, BAD_HANDLE, "rt.free_physical", h)
    ok(e, "rt.release_mem_address", p)
    assert mem_free(e)[0] == mem_free(e)[1], "the memory did not go with the last handle"


def test_rule_13_the_exporter_imports_its_own_v1_handle(actor: MakeActor) -> None:
    e = actor()
    s = export(e, pids=None)
    h = ok(e, "rt.mem_import_from_shareable_handle", s.shareable, 0)
    p = ok(e, "rt.reserve_mem_address", s.size, 0, 0, 0)
    ok(e, "rt.map_mem", p, s.size, 0, h, 0)
    check_shared_both_ways(e, s.ptr, e, p, s.size)
    assert ok(e, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0) == h  # again: the same handle
    ok(e, "rt.free_physical", h)
    ok(e, "rt.free_physical", h)
    fails(e, BAD_HANDLE, "rt.free_physical", h)


def test_rule_13_a_self_import_of_a_revoked_handle_fails(actor: MakeActor) -> None:
    e = actor()
    s = export(e, flags=NO_PID_CHECK)
    ok(e, "rt.unmap_mem", s.ptr)
    ok(e, "rt.free_physical", s.handle)
    for share_type in (DEFAULT,):
        msg = fails(e, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", s.shareable, share_type, 0)
        assert "revoked" in msg
    f = export(e, flags=NO_PID_CHECK, share_type=FABRIC)
    ok(e, "rt.unmap_mem", f.ptr)
    ok(e, "rt.free_physical", f.handle)
    fails(e, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, 0)
    assert ok(e, "rt.get_mem_info", 0)[0] == ok(e, "rt.get_mem_info", 0)[1]


def test_rule_13_importing_again_gives_the_same_handle_with_a_reference_added(actor: MakeActor) -> None:
    """torch_npu's expandable segments import a segment again for a second tensor: the same handle comes back,
    each import needs its own free_physical, and the memory stays until the last (one more is 107017)."""
    e, i = actor(), actor()
    s = export(e, pids=[i.pid])
    h1, p1 = import_map(i, s)
    h2 = ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    h3 = ok(i, "rt.mem_import_from_shareable_handle", s.shareable, 0)
    assert h1 == h2 == h3
    ok(i, "rt.free_physical", h1)
    ok(i, "rt.free_physical", h1)
    assert ok(i, "rt.mem_get_allocation_properties_from_handle", h1)["location"]["id"] == 0  # one left
    p2 = ok(i, "rt.reserve_mem_address", s.size, 0, 0, 0)
    ok(i, "rt.map_mem", p2, s.size, 0, h1, 0)
    check_shared_both_ways(e, s.ptr, i, p2, s.size)
    ok(i, "rt.free_physical", h1)  # the last import's reference: the mappings keep the memory
    fails(i, BAD_HANDLE, "rt.free_physical", h1)  # freed once too often
    assert i.call("!sha256", p1, s.size) == e.call("!sha256", s.ptr, s.size)
    for p in (p1, p2):
        ok(i, "rt.unmap_mem", p)
        ok(i, "rt.release_mem_address", p)


def test_rule_13_a_re_import_is_judged_again(actor: MakeActor) -> None:
    """A re-import asks the broker again, as a new import would: once the exporter freed the handle it fails
    (107017) and the earlier import keeps its memory and its one reference."""
    e, i = actor(), actor()
    s = export(e, pids=[i.pid])
    h, p = import_map(i, s)
    ok(e, "rt.unmap_mem", s.ptr)
    ok(e, "rt.free_physical", s.handle)
    fails(i, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    i.call("!write_bytes", p, b"kept")
    assert i.call("!read", p, 4) == b"kept"
    ok(i, "rt.unmap_mem", p)
    ok(i, "rt.free_physical", h)
    fails(i, BAD_HANDLE, "rt.free_physical", h)


def test_rule_13_concurrent_imports_of_one_handle_in_one_process_share_it(actor: MakeActor) -> None:
    e, i = actor(), actor()
    s = export(e, pids=[i.pid])
    handles = i.call("!threads_import", s.shareable, DEFAULT, 8)
    assert len(set(handles)) == 1 and handles[0] != 0, handles
    for _ in range(8):
        ok(i, "rt.free_physical", handles[0])
    fails(i, BAD_HANDLE, "rt.free_physical", handles[0])


@pytest.mark.parametrize("byte", [6, 12], ids=["flags", "device"])
def test_rule_13_a_fabric_handle_with_other_unchecked_bytes_is_still_the_same_handle(actor: MakeActor,
                                                                                     byte: int) -> None:
    """The FABRIC layout carries fields besides the handle value and the secret; changing one of them does not
    make another handle: importing it again gives the same handle, in the importer and in the exporter."""
    e, i = actor(), actor()
    s = export(e, share_type=FABRIC, pids=[i.pid])
    h = ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, FABRIC, 0)
    changed = bytearray(s.shareable)
    changed[byte] ^= 0x01
    assert ok(i, "rt.mem_import_from_shareable_handle_v2", bytes(changed), FABRIC, 0) == h
    own = ok(e, "rt.mem_import_from_shareable_handle_v2", s.shareable, FABRIC, 0)
    assert ok(e, "rt.mem_import_from_shareable_handle_v2", bytes(changed), FABRIC, 0) == own
    for a, handle in ((i, h), (e, own)):
        ok(a, "rt.free_physical", handle)
        ok(a, "rt.free_physical", handle)
        fails(a, BAD_HANDLE, "rt.free_physical", handle)


def test_rule_13_freeing_a_still_mapped_import_allows_importing_again(actor: MakeActor) -> None:
    e, i = actor(), actor()
    s = export(e, pids=[i.pid])
    h1, p1 = import_map(i, s)
    ok(i, "rt.free_physical", h1)  # the mapping keeps the memory; the handle is freed
    h2 = ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    p2 = ok(i, "rt.reserve_mem_address", s.size, 0, 0, 0)
    ok(i, "rt.map_mem", p2, s.size, 0, h2, 0)
    assert i.call("!sha256", p1, s.size) == i.call("!sha256", p2, s.size) == e.call("!sha256", s.ptr, s.size)


def test_rule_13_v2_import_flags_must_be_0(actor: MakeActor) -> None:
    e, i = actor(), actor()
    s = export(e, pids=[i.pid])
    f = export(e, share_type=FABRIC, pids=[i.pid])
    for flags in (1, 2, -1, None, "0"):
        code = ACL_PARAM if flags in (1, 2) else PARAM  # a non-zero flags value is the acl layer's; no uint64, 107000
        fails(i, code, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, flags)
        fails(i, code, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, flags)
    # the refused imports left nothing behind
    ok(i, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    ok(i, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, 0)


def test_rule_13_v1_import_checks_the_device(actor: MakeActor) -> None:
    e, i = actor(), actor()
    s = export(e, pids=[i.pid])
    fails(i, BAD_DEVICE, "rt.mem_import_from_shareable_handle", s.shareable, 4096)
    fails(i, BAD_DEVICE, "rt.mem_import_from_shareable_handle", s.shareable, -1)
    ok(i, "rt.mem_import_from_shareable_handle", s.shareable, 1)


# ---------------------------------------------------------------- rule 14


def test_rule_14_exporter_free_revokes_but_importers_keep_their_memory(actor: MakeActor) -> None:
    e, i, late = actor(), actor(), actor()
    s = export(e, pids=[i.pid, late.pid])
    free0, total = mem_free(e)
    assert free0 == total - s.size
    ih, ip = import_map(i, s)
    digest = e.call("!sha256", s.ptr, s.size)
    assert i.call("!sha256", ip, s.size) == digest
    assert mem_free(i) == (total - s.size, total)  # one allocation, counted once on the node

    ok(e, "rt.free_physical", s.handle)  # still mapped in e: revoked at free, not at unmap
    msg = fails(late, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    assert "revoked" in msg or "unknown" in msg
    ok(e, "rt.unmap_mem", s.ptr)
    fails(late, BAD_HANDLE, "rt.mem_import_from_shareable_handle", s.shareable, 0)
    fails(e, BAD_HANDLE, "rt.mem_set_pid_to_shareable_handle_v2", s.shareable, DEFAULT, [late.pid])

    assert i.call("!sha256", ip, s.size) == digest  # intact
    data = os.urandom(4096)
    i.call("!write_bytes", ip + s.size - 4096, data)
    assert i.call("!read", ip + s.size - 4096, 4096) == data
    assert mem_free(i) == (total - s.size, total)  # the importer still holds it

    ok(i, "rt.free_physical", ih)
    assert mem_free(i) == (total - s.size, total)  # still mapped in i
    assert i.call("!read", ip + s.size - 4096, 4096) == data
    ok(i, "rt.unmap_mem", ip)
    assert mem_free(i) == (total, total)  # the last reference went: the memory is back


def test_rule_14_exporter_that_unmapped_first_revokes_at_free(actor: MakeActor) -> None:
    """Unmapped before it is freed, the allocation's last reference goes at free: that one step revokes the
    handle and returns the exporter's share, while the importer keeps the memory."""
    e, i, late = actor(), actor(), actor()
    s = export(e, pids=[i.pid, late.pid])
    _, total = mem_free(e)
    ih, ip = import_map(i, s)
    digest = e.call("!sha256", s.ptr, s.size)
    ok(e, "rt.unmap_mem", s.ptr)
    ok(e, "rt.free_physical", s.handle)
    fails(late, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    assert i.call("!sha256", ip, s.size) == digest
    assert mem_free(i) == (total - s.size, total)  # the importer still holds it
    ok(i, "rt.unmap_mem", ip)
    ok(i, "rt.free_physical", ih)
    assert mem_free(i) == (total, total)


def test_rule_14_exporter_death_revokes_but_importers_keep_their_memory(actor: MakeActor) -> None:
    e, i, late = actor(), actor(), actor()
    s = export(e, pids=[i.pid, late.pid])
    f = export(e, share_type=FABRIC, pids=[i.pid, late.pid])
    _, total = mem_free(e)
    ih, ip = import_map(i, s)
    fh, fp = import_map(i, f, FABRIC)
    digest, fdigest = e.call("!sha256", s.ptr, s.size), e.call("!sha256", f.ptr, f.size)

    e.kill()  # SIGKILL: no cleanup in the exporter; its connection closes with it

    fails(late, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", s.shareable, DEFAULT, 0)
    fails(late, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, 0)
    assert i.call("!sha256", ip, s.size) == digest
    assert i.call("!sha256", fp, f.size) == fdigest
    i.call("!write", ip, 0xC3, s.size)
    assert i.call("!read", ip + s.size - 16, 16) == b"\xc3" * 16
    assert mem_free(i) == (total - 2 * s.size, total)

    ok(i, "rt.unmap_mem", ip)
    ok(i, "rt.free_physical", ih)
    assert mem_free(i) == (total - f.size, total)
    ok(i, "rt.unmap_mem", fp)
    ok(i, "rt.free_physical", fh)
    assert mem_free(late) == (total, total)


def test_rule_14_memory_returns_when_the_last_importer_dies(actor: MakeActor) -> None:
    e, i = actor(), actor()
    s = export(e, pids=[i.pid])
    _, total = mem_free(e)
    import_map(i, s)
    ok(e, "rt.free_physical", s.handle)
    ok(e, "rt.unmap_mem", s.ptr)
    assert mem_free(e) == (total - s.size, total)  # i holds it
    i.kill()
    # the broker drops i's hold when its connection closes; ask until it has (no timing involved:
    # every answer is a broker reply, and the loop ends as soon as the reply shows the release)
    for _ in range(10_000):
        if mem_free(e) == (total, total):
            break
    assert mem_free(e) == (total, total)


# ---------------------------------------------------------------- rule 15


def test_rule_15_bare_tgid_is_the_pid_the_broker_sees(actor: MakeActor) -> None:
    a = actor()
    assert ok(a, "rt.device_get_bare_tgid") == a.pid == a.proc.pid


def test_rule_15_bare_tgid_is_the_host_pid_inside_a_pid_namespace(actor: MakeActor) -> None:
    e = actor()
    unshare = ["unshare", "--pid", "--fork", "--kill-child"]
    require(shutil.which("unshare"), "no unshare(1) here")
    try:
        c = actor(prefix=unshare)
    except ActorDied:  # expected only where unshare itself is refused: any other death fails the test
        why = refusal(unshare)
        require(not why, f"cannot start a process in a new pid namespace: {why}")
        raise
    assert c.pid == 1, "the actor should see itself as pid 1 in its own namespace"
    kids = host_children(c.proc.pid)  # c.proc is `unshare`; its one child is the actor, by its host pid
    assert len(kids) == 1, kids
    host_pid = kids[0]
    tgid = ok(c, "rt.device_get_bare_tgid")
    assert tgid == host_pid != 1

    wrong = export(e, pids=[1])  # the pid the container believes it has is not the one that counts
    fails(c, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", wrong.shareable, DEFAULT, 0)
    s = export(e, pids=[tgid])
    _, cp = import_map(c, s)
    check_shared_both_ways(e, s.ptr, c, cp, s.size)


# ---------------------------------------------------------------- rule 16


def test_rule_16_bad_default_handles_fail_cleanly(actor: MakeActor, broker: BrokerProc) -> None:
    e, i = actor(), actor()
    s = export(e, pids=[i.pid])
    unknown = int.from_bytes(os.urandom(8), "little") | 1
    v2, v1 = "rt.mem_import_from_shareable_handle_v2", "rt.mem_import_from_shareable_handle"
    for value, code in [
        (unknown, BAD_HANDLE),
        ((1 << 64) - 1, BAD_HANDLE),
        (0, BAD_HANDLE),
        (-1, PARAM),
        (1 << 64, PARAM),
        ("123", PARAM),
        (None, PARAM),
        (1.0, PARAM),
        (b"\x01" * 8, PARAM),
        ([s.shareable], PARAM),
    ]:
        fails(i, ACL_PARAM if value is None else code, v2, value, DEFAULT, 0)  # V2: None is a NULL handle (acl)
        fails(i, code, v1, value, 0)
    fails(e, BAD_HANDLE, "rt.mem_set_pid_to_shareable_handle_v2", unknown, DEFAULT, [i.pid])
    fails(e, BAD_HANDLE, "rt.mem_set_pid_to_shareable_handle", unknown, [i.pid])
    fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle_v2", "x", DEFAULT, [i.pid])
    # a share type that is neither DEFAULT nor FABRIC
    fails(i, PARAM, "rt.mem_import_from_shareable_handle_v2", s.shareable, 3, 0)
    fails(i, PARAM, "rt.mem_import_from_shareable_handle_v2", s.shareable, 0, 0)
    # a DEFAULT handle presented as FABRIC
    fails(i, PARAM, "rt.mem_import_from_shareable_handle_v2", s.shareable, FABRIC, 0)
    # nothing crashed or stuck: the real handle still imports
    assert broker.alive()
    _, ip = import_map(i, s)
    check_shared_both_ways(e, s.ptr, i, ip, s.size)


def test_rule_16_bad_fabric_handles_fail_cleanly(actor: MakeActor, broker: BrokerProc) -> None:
    e, i = actor(), actor()
    f = export(e, flags=NO_PID_CHECK, share_type=FABRIC)  # validation off: only the handle itself can be wrong
    good = f.shareable
    imp = "rt.mem_import_from_shareable_handle_v2"

    for shape in (b"", good[:127], good[:64], good + b"\0", good * 2, 12345, "VMMF"):
        fails(i, PARAM, imp, shape, FABRIC, 0)
    fails(i, ACL_PARAM, imp, None, FABRIC, 0)  # a NULL handle: the acl layer's check
    fails(i, BAD_HANDLE, imp, os.urandom(128), FABRIC, 0)  # bad magic (random)

    def flipped(at: int, xor: int = 0xFF) -> bytes:
        b = bytearray(good)
        b[at] ^= xor
        return bytes(b)

    fails(i, BAD_HANDLE, imp, flipped(0), FABRIC, 0)  # magic
    fails(i, BAD_HANDLE, imp, flipped(4), FABRIC, 0)  # version
    fails(i, BAD_HANDLE, imp, flipped(5), FABRIC, 0)  # share type
    fails(i, BAD_HANDLE, imp, flipped(6, 0x02), FABRIC, 0)  # unknown flag bit
    fails(i, BAD_HANDLE, imp, flipped(16), FABRIC, 0)  # another 64-bit handle: unknown
    fails(i, BAD_HANDLE, imp, bytes(16) + bytes(good[16:]), FABRIC, 0)  # all-zero head
    for at in (64, 80, 95):  # the secret
        msg = fails(i, BAD_HANDLE, imp, flipped(at, 0x01), FABRIC, 0)
        assert "secret" in msg
    fails(i, BAD_HANDLE, imp, flipped(100), FABRIC, 0)  # reserved must be zero
    fails(i, BAD_HANDLE, imp, flipped(127), FABRIC, 0)
    # garbage in the trustlist call, too
    fails(e, PARAM, "rt.mem_set_pid_to_shareable_handle_v2", good[:100], FABRIC, [i.pid])
    fails(e, BAD_HANDLE, "rt.mem_set_pid_to_shareable_handle_v2", os.urandom(128), FABRIC, [i.pid])

    assert broker.alive()
    _, ip = import_map(i, f, FABRIC)
    check_shared_both_ways(e, f.ptr, i, ip, f.size)


# ---------------------------------------------------------------- rule 17


def test_rule_17_fabric_on_the_same_server_works_like_default(actor: MakeActor) -> None:
    e, i, stranger, anyone = actor(), actor(), actor(), actor()
    f = export(e, share_type=FABRIC)
    msg = fails(i, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, 0)
    assert "trustlist" in msg
    ok(e, "rt.mem_set_pid_to_shareable_handle_v2", f.shareable, FABRIC, [i.pid])
    _, ip = import_map(i, f, FABRIC)
    check_shared_both_ways(e, f.ptr, i, ip, f.size)
    fails(stranger, NO_PERMISSION, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, 0)
    assert ok(i, "rt.mem_import_from_shareable_handle_v2", f.shareable, FABRIC, 0) > 0  # again: the same handle

    g = export(e, flags=NO_PID_CHECK, share_type=FABRIC)
    _, gp = import_map(anyone, g, FABRIC)
    check_shared_both_ways(e, g.ptr, anyone, gp, g.size)


def test_rule_17_fabric_from_another_server_needs_the_transport(actor: MakeActor) -> None:
    e = actor()
    far = actor(VMMSHARE_SERVER_ID=OTHER_SERVER)
    f = export(e, share_type=FABRIC, pids=[far.pid])
    g = export(e, flags=NO_PID_CHECK, share_type=FABRIC)
    for s in (f, g):
        msg = fails(far, NOT_SUPPORTED, "rt.mem_import_from_shareable_handle_v2", s.shareable, FABRIC, 0)
        assert "cross-server" in msg and "transport" in msg
    # a handle doctored to name another server is refused the same way on this one
    near = actor()
    doctored = bytearray(g.shareable)
    doctored[8:12] = (int(OTHER_SERVER, 16)).to_bytes(4, "little")
    fails(near, NOT_SUPPORTED, "rt.mem_import_from_shareable_handle_v2", bytes(doctored), FABRIC, 0)
    ok(near, "rt.mem_import_from_shareable_handle_v2", g.shareable, FABRIC, 0)


@pytest.mark.parametrize("flags", [0, NO_PID_CHECK])
def test_rule_17_fabric_handle_layout(actor: MakeActor, broker: BrokerProc, flags: int) -> None:
    e = actor()
    device = 3
    prop = {**PROP, "location": {"id": device, "type": 1}}
    size = 2 * MiB2
    f = export(e, flags=flags, share_type=FABRIC, size=size, prop=prop)
    raw: bytes = f.shareable
    assert len(raw) == 128
    magic, version, share_type, hflags, server, dev, handle, hsize = struct.unpack_from("<4sBBHIIQQ", raw)
    assert magic == b"VMMF"
    assert version == 1
    assert share_type == FABRIC
    assert hflags == flags
    assert server == SERVER_ID
    assert dev == device
    assert hsize == size
    assert handle != 0
    assert raw[32:64] == bytes(32)  # no cross-server endpoint configured
    secret = raw[64:96]
    assert len(set(secret)) > 4  # 32 random bytes, not a constant
    assert raw[96:128] == bytes(32)
    # the 64-bit field is the node's handle: the broker lists it under that number
    out = subprocess.run(
        [sys.executable, "-m", "vmmshare.cli", "ls", "--json"],
        env=broker.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = json.loads(out)["exports"]
    assert [r["handle"] for r in rows] == [f"{handle:#018x}"]
    assert rows[0]["share_type"] == "fabric" and rows[0]["device"] == device and rows[0]["size"] == size
    # two exports never share a secret or a handle
    g = export(e, flags=flags, share_type=FABRIC)
    assert g.shareable[64:96] != secret and g.shareable[16:24] != raw[16:24]


def test_rule_17_fabric_handle_carries_the_exporters_server_id(actor: MakeActor) -> None:
    """Processes whose VMMSHARE_SERVER_ID differs from the broker's still agree with each other."""
    own = "0x77"
    e, i = actor(VMMSHARE_SERVER_ID=own), actor(VMMSHARE_SERVER_ID=own)
    f = export(e, flags=NO_PID_CHECK, share_type=FABRIC)
    assert struct.unpack_from("<I", f.shareable, 8)[0] == int(own, 16)
    _, ip = import_map(i, f, FABRIC)
    check_shared_both_ways(e, f.ptr, i, ip, f.size)
