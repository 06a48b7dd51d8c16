"""The broker's defences that are rules of its books, on the ledger alone (docs/security.md, threat table): pid
lookups that fail, trustlists re-added, clients the broker cannot see or that did not open the connection, the
quotas of each user, the seals of an exported memfd, and listings that always fit a frame.

The same defences against a real broker, real processes and other users are in test_security.py.
"""

from __future__ import annotations

import errno
import fcntl
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from test_ledger import (
    BAD_HANDLE,
    CAPACITY,
    DEFAULT,
    ENDPOINT,
    FABRIC,
    NO_MEMORY,
    NO_PERMISSION,
    NO_PID_CHECK,
    OTHER,
    PARAM,
    Books,
    MiB2,
    fabric_books,
)
from vmmshare.books.ledger import LIST_IMPORTERS, LIST_PAGE, MAX_GPUS, Lookups
from vmmshare.books.usage import FDS_PER_CONNECTION
from vmmshare.config import Quotas
from vmmshare.wire import local as P
from vmmshare.wire.handles import MAX_TRUSTLIST


@pytest.fixture
def books() -> Books:
    return Books()


RESOURCE = 207005  # ACL_ERROR_RT_RESOURCE_ALLOC_FAIL: a limit of the broker or of the user
IPC_ERROR = 507022


def _pages(books: Books, viewer: Any) -> list[dict[str, Any]]:
    pages: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        reply = books.ask(viewer, P.List(offset))
        assert isinstance(reply, P.Listing)
        assert len(reply.page.encode()) <= P.MAX_BODY, "a page fits one frame"
        pages.append(json.loads(reply.page))  # every page is JSON on its own
        offset = pages[-1]["next"]
        assert len(pages) < 10_000
    return pages


# ---------------------------------------------------------------- a pid lookup that fails binds nothing


@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENOMEM, errno.EACCES])
def test_fail_closed_a_trustlist_entry_that_cannot_be_bound_is_refused(books: Books, err: int) -> None:
    """When the broker cannot tell which process has a pid (out of fds: EMFILE), the entry used to be bound to
    nothing, so whoever got that pid later could import. Now the whole request is refused (207005) and nothing is
    added; only a pid that no process has ("no such process") may stay unbound."""
    a = books.client(1)
    books.alive[9] = (None, 7009)
    books.failing[9] = OSError(err, "injected")
    _, shareable, _, _ = books.export(a, pids=(5,))
    reply = books.ask(a, P.SetPids(shareable, DEFAULT, (6, 9)))
    assert isinstance(reply, P.Error) and reply.code == RESOURCE, reply
    assert "pid 9" in reply.message and "unchanged" in reply.message
    assert set(books.ledger.exports[shareable].trust) == {5}, "nothing was added, not even pid 6"
    stranger = books.client(9, identity=(None, 7777))  # whoever has pid 9 later
    assert books.imports(stranger, shareable) == NO_PERMISSION
    hold = books.charge(a)
    fd = books.memfd()
    reply = books.ask(a, books.export_request(hold, pids=(9,)), fd)
    assert isinstance(reply, P.Error) and reply.code == RESOURCE, "an export whose trustlist cannot be bound"
    assert fd in books.closed and len(books.ledger.exports) == 1


# ---------------------------------------------------------------- re-adding a pid keeps its first binding


def test_rule_12_readding_the_pid_of_a_process_that_died_never_rebinds_it(books: Books) -> None:
    """The trusted process exited; the exporter re-sends its trustlist, first while nobody has the pid, then once
    another process has it. The entry used to be bound anew to whoever had the pid at the re-add, so the new owner
    of the pid imported. Rule 12: an entry whose process died stays refused, whatever is re-added."""
    a = books.client(1)
    books.alive.update({9: (None, 7009), 10: (None, 7010)})  # the trusted processes
    _, shareable, _, _ = books.export(a, pids=(9, 10))
    del books.alive[9]  # it exited
    assert books.code(a, P.SetPids(shareable, DEFAULT, (9,))) == 0
    assert books.imports(books.client(9, identity=(None, 8009)), shareable) == NO_PERMISSION, (
        "a process that got the pid after the re-add imported")
    books.lookups.clear()
    assert books.code(a, P.SetPids(shareable, DEFAULT, (9, 10))) == 0  # re-added while 8009 has the pid
    assert books.lookups == [], "a bound entry is not looked up again"
    assert books.imports(books.client(9, identity=(None, 8009)), shareable) == NO_PERMISSION
    assert books.ledger.exports[shareable].trust[9] == (None, 7009)
    assert books.ledger.usage.users[1000].trust == 2


def test_readding_the_same_live_process_changes_nothing(books: Books) -> None:
    a = books.client(1)
    books.alive.update({9: (None, 7009), 10: (None, 7010)})
    _, shareable, _, _ = books.export(a, pids=(9,))
    before = dict(books.ledger.exports[shareable].trust)
    books.lookups.clear()
    assert books.code(a, P.SetPids(shareable, DEFAULT, (9, 9, 10, 9))) == 0
    assert books.lookups == [10], "each new pid is looked up once, duplicates or not; a bound one not at all"
    assert books.ledger.exports[shareable].trust == {**before, 10: (None, 7010)}
    assert books.ledger.usage.users[1000].trust == 2


def test_an_entry_bound_to_nothing_is_bound_once_its_process_exists(books: Books) -> None:
    """A pid added before its process runs is bound to nothing; re-adding it once it runs binds it."""
    a = books.client(1)
    _, shareable, _, _ = books.export(a, pids=(9,))
    books.alive[9] = (None, 7009)
    assert books.code(a, P.SetPids(shareable, DEFAULT, (9,))) == 0
    assert books.imports(books.client(9, identity=(None, 8009)), shareable) == NO_PERMISSION
    assert books.imports(books.client(9, identity=(None, 7009)), shareable) == 0


# ---------------------------------------------------------------- trustlist work: each pid once


def test_trustlist_duplicates_are_looked_up_once(books: Books) -> None:
    """A SET_PIDS of 4,096 copies of one pid cost 4,096 lookups (pidfd_open each); now one."""
    a = books.client(1)
    _, shareable, _, _ = books.export(a)
    books.lookups.clear()
    assert books.code(a, P.SetPids(shareable, DEFAULT, (77,) * 4096)) == 0
    assert books.lookups == [77]
    assert books.ledger.pids_to_bind(a, P.SetPids(shareable, DEFAULT, tuple(range(4096, 0, -1)) * 2)) == list(
        range(4096, 0, -1)), "each once, in the request's order"


def test_trustlist_lookups_made_ahead_are_used_and_a_failed_one_refuses(books: Books) -> None:
    """The server looks a long trustlist up over several turns of its loop (`look_up`) and hands the results in."""
    a = books.client(1)
    books.alive[9] = (None, 7009)
    _, shareable, _, _ = books.export(a)
    pids = tuple(range(2, 600))
    found = books.ledger.look_up(books.ledger.pids_to_bind(a, P.SetPids(shareable, DEFAULT, pids)))
    books.lookups.clear()
    reply, _ = books.ledger.handle(a, P.SetPids(shareable, DEFAULT, pids), found=found)
    assert reply == P.Ok() and books.lookups == [], "nothing looked up twice"
    assert books.imports(books.client(9, identity=(None, 7009)), shareable) == 0
    found = Lookups({p: (None, None) for p in range(600, 700) if p != 650}, {650: OSError(errno.EMFILE, "injected")})
    reply, _ = books.ledger.handle(a, P.SetPids(shareable, DEFAULT, tuple(range(600, 700))), found=found)
    assert isinstance(reply, P.Error) and reply.code == RESOURCE and len(books.ledger.exports[shareable].trust) == 598


@pytest.mark.parametrize("request_of", [lambda v: P.SetPids(v, DEFAULT, (0, 5)), lambda v: P.SetPids(v ^ 4, DEFAULT,
                                        (5,)), lambda v: P.Charge(0, MiB2)], ids=["bad_pid", "unknown", "no_pids"])
def test_requests_refused_before_any_lookup_ask_for_none(books: Books, request_of: Any) -> None:
    a = books.client(1)
    _, shareable, _, _ = books.export(a)
    assert books.ledger.pids_to_bind(a, request_of(shareable)) == []


# ---------------------------------------------------------------- who sends: the connection's process only


def test_a_client_the_broker_cannot_see_is_refused() -> None:
    """A broker in a child pid namespace gets pid 0 for every process outside it (SO_PEERCRED); such clients were
    served as one and the same pid 0. They are refused at once, saying why."""
    books = Books()
    with pytest.raises(Exception) as refused:
        books.ledger.connect(0, 1000, (None, None))
    assert getattr(refused.value, "code", None) == NO_PERMISSION
    assert "pid namespace" in str(refused.value)
    assert not books.ledger.clients and not books.ledger.usage.users


@pytest.mark.parametrize("request_of", [P.BareTgid, lambda: P.Release(1), lambda: P.MemInfo(0)],
                         ids=["bare_tgid", "release", "mem_info"])
def test_a_request_sent_by_another_process_than_the_connections_is_refused(books: Books, request_of: Any) -> None:
    """A connection inherited across a C fork() or passed by SCM_RIGHTS used to act as its owner. Each packet now
    carries its sender's pid (SCM_CREDENTIALS) and only the process that opened the connection is served."""
    a = books.client(1)
    hold, shareable, _, _ = books.export(a, flags=NO_PID_CHECK)
    reply, _ = books.ledger.handle(a, request_of(), sender=2)
    assert isinstance(reply, P.Error) and reply.code == NO_PERMISSION
    assert "belongs to pid 1" in reply.message and "pid 2" in reply.message
    reply, _ = books.ledger.handle(a, P.Release(hold), sender=2)
    assert isinstance(reply, P.Error) and shareable in books.ledger.exports, "the owner's export is untouched"
    fd = books.memfd()
    reply, _ = books.ledger.handle(a, books.export_request(books.charge(a)), fd, sender=0)
    assert isinstance(reply, P.Error) and reply.code == NO_PERMISSION and fd in books.closed
    assert books.ledger.handle(a, P.BareTgid(), sender=1)[0] == P.Pid(1)


# ---------------------------------------------------------------- quotas of each user


def test_quota_connections_per_user() -> None:
    books = Books(quotas=Quotas(connections=2))
    a, _ = books.client(1, uid=1000), books.client(2, uid=1000)
    with pytest.raises(Exception) as refused:
        books.client(3, uid=1000)
    assert getattr(refused.value, "code", None) == RESOURCE and "VMMSHARE_QUOTA_CONNECTIONS=2" in str(refused.value)
    books.client(4, uid=2000)  # another user is not affected
    books.ledger.disconnect(a)
    books.client(5, uid=1000)


def test_quota_exports_per_user_and_each_refusal_lets_the_fd_go() -> None:
    books = Books(quotas=Quotas(exports=3))
    a, b = books.client(1, uid=1000), books.client(2, uid=1000)
    holds = [books.export(c)[0] for c in (a, b, a)]
    hold = books.charge(b)
    fd = books.memfd()
    reply = books.ask(b, books.export_request(hold), fd)
    assert isinstance(reply, P.Error) and reply.code == RESOURCE and "VMMSHARE_QUOTA_EXPORTS=3" in reply.message
    assert fd in books.closed
    assert books.code(a, P.Release(holds[0])) == 0  # a revoked export no longer counts
    assert books.code(b, books.export_request(hold), books.memfd()) == 0
    assert books.export(books.client(3, uid=2000))[1] in books.ledger.exports


def test_quota_holds_per_user_counts_allocations_and_imports() -> None:
    books = Books(quotas=Quotas(holds=3))
    a, b = books.client(1, uid=1000), books.client(2, uid=2000)
    _, shareable, _, _ = books.export(b, flags=NO_PID_CHECK)
    books.charge(a)
    books.charge(a, device=-1)
    assert books.imports(a, shareable) == 0
    assert books.code(a, P.Charge(-1, 1)) == RESOURCE
    assert books.imports(a, shareable) == RESOURCE
    assert books.code(a, P.Release(next(iter(a.holds)))) == 0
    assert books.imports(a, shareable) == 0


def test_quota_trustlist_entries_per_user() -> None:
    books = Books(quotas=Quotas(trustlist=5000))
    a = books.client(1)
    hold, _, _, _ = books.export(a, pids=tuple(range(1, 4001)))
    _, second, _, _ = books.export(a, pids=tuple(range(1, 1001)))
    reply = books.ask(a, P.SetPids(second, DEFAULT, (5000,)))
    assert isinstance(reply, P.Error) and reply.code == RESOURCE and "VMMSHARE_QUOTA_TRUSTLIST=5000" in reply.message
    assert books.code(a, P.SetPids(second, DEFAULT, (1, 2))) == 0, "entries already listed cost nothing"
    assert books.code(a, P.Release(hold)) == 0, "a revoked export gives its entries back"
    assert books.code(a, P.SetPids(second, DEFAULT, tuple(range(5000, 8000)))) == 0
    assert books.ledger.usage.users[1000].trust == 4000


def test_rule_12_one_trustlist_holds_at_most_4096_pids_of_this_and_other_servers_together() -> None:
    """The cap counts the pids of this server and the (server, pid) pairs of others on the same export: neither
    kind of entry slips past it after the other filled the list."""
    books = fabric_books()
    exporter = books.client(10)
    _, value, _, _ = books.export(exporter, FABRIC)
    assert books.code(exporter, P.SetRemotePids(value, FABRIC, OTHER, tuple(range(1, 2049)))) == 0
    assert books.code(exporter, P.SetPids(value, FABRIC, tuple(range(1, 2050)))) == PARAM
    assert books.code(exporter, P.SetPids(value, FABRIC, tuple(range(1, 2049)))) == 0
    assert books.code(exporter, P.SetRemotePids(value, FABRIC, OTHER + 1, (1,))) == PARAM
    share = books.ledger.exports[value]
    assert len(share.trust) + len(share.remote_trust) == MAX_TRUSTLIST == 4096


def test_quota_memory_per_user_and_device() -> None:
    books = Books(quotas=Quotas(memory=4 * MiB2))
    a, b = books.client(1, uid=1000), books.client(2, uid=2000)
    first = books.charge(a, 3 * MiB2)
    reply = books.ask(a, P.Charge(0, 2 * MiB2))
    assert isinstance(reply, P.Error) and reply.code == NO_MEMORY and "VMMSHARE_QUOTA_MEMORY" in reply.message
    assert books.code(a, P.Charge(1, 4 * MiB2)) == 0, "the limit is per device"
    assert books.code(a, P.Charge(-1, 64 * MiB2)) == 0, "host memory is not device memory"
    assert books.code(b, P.Charge(0, 4 * MiB2)) == 0, "another user has a limit of its own"
    assert books.code(a, P.Release(first)) == 0
    assert books.code(a, P.Charge(0, 4 * MiB2)) == 0


def _held_memory(books: Books, uid: int) -> int:
    tally = books.ledger.usage.users.get(uid)
    return 0 if tally is None else tally.memory[0]


def test_quota_memory_moves_to_the_importer_that_keeps_it_alive_once_the_exporter_freed_it() -> None:
    """An exporter that freed what it exported stayed charged for it while importers kept it alive, so that user
    holding nothing was refused (207001). The charge moves to the earliest remaining importer, and on, until the
    last holder frees it; the node's capacity is unchanged all along."""
    books = Books(quotas=Quotas(memory=4 * MiB2))
    a, b, c = books.client(1, uid=1000), books.client(2, uid=2000), books.client(3, uid=3000)
    exports = [books.export(a, flags=NO_PID_CHECK) for _ in range(4)]
    for _, shareable, _, _ in exports:
        assert books.imports(b, shareable) == 0
    assert books.imports(c, exports[0][1]) == 0
    assert books.code(a, P.Charge(0, MiB2)) == NO_MEMORY
    for hold, _, _, _ in exports:
        assert books.code(a, P.Release(hold)) == 0
    assert _held_memory(books, 1000) == 0 and _held_memory(books, 2000) == 4 * MiB2
    assert books.free() == CAPACITY - 4 * MiB2, "the memory is still there"
    assert books.code(a, P.Charge(0, 4 * MiB2)) == 0, "the exporter holds nothing: its quota is whole"
    assert books.code(b, P.Charge(0, MiB2)) == NO_MEMORY, "the importer keeping the memory alive is charged"
    share = books.ledger.holds[exports[0][0]].memory.share if exports[0][0] in books.ledger.holds else None
    assert share is None, "the exporter's holds are gone"
    first = next(h for h, held in books.ledger.holds.items()
                 if held.client is b and held.memory.share is not None and held.memory.share.handle == exports[0][1])
    assert books.code(b, P.Release(first)) == 0
    assert _held_memory(books, 2000) == 3 * MiB2 and _held_memory(books, 3000) == MiB2, "on to the next holder"
    books.ledger.disconnect(c)
    books.ledger.disconnect(b)
    assert _held_memory(books, 2000) == _held_memory(books, 3000) == 0
    assert books.free() == CAPACITY - 4 * MiB2, "only a's new charge is left"


def test_quota_memory_stays_with_an_exporter_that_still_holds_it_after_its_own_import_goes() -> None:
    """Rule 13 and the charge's move together: the exporter's own import released while its charge is still held
    leaves the charge where it is (the broker raised StopIteration here, with nobody else importing); once the
    exporter frees its charge too, the memory goes, or moves to the other importer."""
    books = Books(quotas=Quotas(memory=4 * MiB2))
    a, b = books.client(1, uid=1000), books.client(2, uid=2000)
    alone, shareable, _, _ = books.export(a, flags=NO_PID_CHECK)
    assert books.imports(a, shareable) == 0
    (own,) = a.holds - {alone}
    assert books.code(a, P.Release(own)) == 0
    assert _held_memory(books, 1000) == MiB2, "the exporter still holds its charge"
    assert books.code(a, P.Release(alone)) == 0
    assert _held_memory(books, 1000) == 0 and books.free() == CAPACITY
    shared, shareable, _, _ = books.export(a, flags=NO_PID_CHECK)
    assert books.imports(a, shareable) == 0 and books.imports(b, shareable) == 0
    (own,) = {h for h in a.holds if h != shared}
    assert books.code(a, P.Release(own)) == 0
    assert _held_memory(books, 1000) == MiB2 and _held_memory(books, 2000) == 0
    assert books.code(a, P.Release(shared)) == 0
    assert _held_memory(books, 1000) == 0 and _held_memory(books, 2000) == MiB2, "on to the importer keeping it"
    books.ledger.disconnect(b)
    assert _held_memory(books, 2000) == 0 and books.free() == CAPACITY


def test_quota_memory_kept_alive_only_by_another_servers_importer_stays_with_its_exporter() -> None:
    """The charge moves to an importer of this node only: a user of another server has no memory tally here (its
    holds are counted by (server id, uid)), so charging it would charge the same-numbered local user, and charging
    nobody would let an exporter escape its quota through another server."""
    books = Books(quotas=Quotas(memory=4 * MiB2))
    books.ledger.endpoint = ENDPOINT
    a, local = books.client(1, uid=1000), books.client(2, uid=2000)
    far = books.ledger.connect(77, 2000, (None, None), server=OTHER)  # uid 2000 of another server
    hold, shareable, secret, _ = books.export(a, FABRIC, flags=NO_PID_CHECK)
    books.ledger.admit(far, shareable, FABRIC, secret)
    assert books.code(a, P.Release(hold)) == 0
    assert _held_memory(books, 1000) == MiB2 and _held_memory(books, 2000) == 0, "no local user keeps it: unmoved"
    assert books.free() == CAPACITY - MiB2
    books.ledger.disconnect(far)
    assert _held_memory(books, 1000) == 0 and books.free() == CAPACITY
    far = books.ledger.connect(78, 2000, (None, None), server=OTHER)
    hold, shareable, secret, _ = books.export(a, FABRIC, flags=NO_PID_CHECK)
    books.ledger.admit(far, shareable, FABRIC, secret)
    assert books.imports(local, shareable, FABRIC, secret) == 0
    assert books.code(a, P.Release(hold)) == 0
    assert _held_memory(books, 1000) == 0 and _held_memory(books, 2000) == MiB2, "the local importer is charged"
    books.ledger.disconnect(local)
    books.ledger.disconnect(far)
    assert _held_memory(books, 2000) == 0 and books.free() == CAPACITY


def test_quota_memory_an_importer_freed_is_not_left_charged_to_it_while_another_server_keeps_it_alive() -> None:
    """The attack: a user exports FABRIC memory, has a process of its own on another server import it, hands the
    handle to a local user (who imports it), and frees: the charge moves to that local importer. The importer frees
    too, and stayed charged for memory it no longer holds for as long as the other server's hold lives (its next
    allocation refused, 207001). Memory only another server keeps alive is charged to its exporter's user."""
    books = Books(quotas=Quotas(memory=4 * MiB2))
    books.ledger.endpoint = ENDPOINT
    attacker, victim = books.client(1, uid=1000), books.client(2, uid=2000)
    far = books.ledger.connect(77, 1000, (None, None), server=OTHER)  # the attacker's process on another server
    hold, shareable, secret, _ = books.export(attacker, FABRIC, flags=NO_PID_CHECK)
    books.ledger.admit(far, shareable, FABRIC, secret)
    assert books.imports(victim, shareable, FABRIC, secret) == 0
    (imported,) = victim.holds
    assert books.code(attacker, P.Release(hold)) == 0
    assert _held_memory(books, 2000) == MiB2, "the local importer keeps it alive: it is charged"
    assert books.code(victim, P.Release(imported)) == 0
    assert _held_memory(books, 2000) == 0, "the importer holds nothing: it is charged nothing"
    assert _held_memory(books, 1000) == MiB2, "kept alive by another server only: its exporter's user is charged"
    assert books.code(victim, P.Charge(0, 4 * MiB2)) == 0
    assert books.free() == CAPACITY - 5 * MiB2
    books.ledger.disconnect(far)
    assert _held_memory(books, 1000) == 0 and books.free() == CAPACITY - 4 * MiB2


def test_the_broker_fd_budget_covers_connections_and_exports() -> None:
    """Whatever the quotas, the broker never hands out the file descriptors it needs itself (to accept, to look a
    pid up): connections and exports past its budget are refused with 207005."""
    books = Books(fd_budget=3 * FDS_PER_CONNECTION + 2)
    a, b, _ = books.client(1), books.client(2, uid=2000), books.client(3, uid=3000)
    books.export(a)
    books.export(b)
    with pytest.raises(Exception) as refused:
        books.client(4, uid=4000)
    assert getattr(refused.value, "code", None) == RESOURCE and "file descriptors" in str(refused.value)
    reply = books.ask(a, books.export_request(books.charge(a)), books.memfd())
    assert isinstance(reply, P.Error) and reply.code == RESOURCE and "ulimit -n" in reply.message
    books.ledger.disconnect(b)  # its connection and its export
    books.client(4, uid=4000)
    books.export(a)
    assert books.ledger.usage.fds == 3 * FDS_PER_CONNECTION + 2


def test_a_user_who_left_leaves_nothing_in_the_tallies(books: Books) -> None:
    a = books.client(1, uid=1000)
    b = books.client(2, uid=2000)
    _, shareable, _, _ = books.export(a, pids=(2, 3, 4))
    books.charge(a, device=-1)
    assert books.imports(b, shareable) == 0
    books.ledger.disconnect(a)
    books.ledger.disconnect(b)
    assert books.ledger.usage.users == {} and books.ledger.usage.fds == 0


# ---------------------------------------------------------------- seals of an exported memfd


SEAL_CASES = [
    # (id, seals of the attached memfd (-1: a file that takes no seals), expected code)
    ("sealed", fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL, 0),
    ("not_a_memfd", -1, PARAM),
    ("no_seals", 0, PARAM),
    ("seal_seal_only", fcntl.F_SEAL_SEAL, PARAM),  # a tmpfs file, or an old hugetlb memfd
    ("can_shrink", fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL, PARAM),
    ("can_grow", fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL, PARAM),
    ("seals_still_open", fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, PARAM),
    ("write_sealed", fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL | fcntl.F_SEAL_WRITE, PARAM),
]


@pytest.mark.parametrize(("seals", "code"), [c[1:] for c in SEAL_CASES], ids=[c[0] for c in SEAL_CASES])
def test_unsealed_exports_are_refused(books: Books, seals: int, code: int) -> None:
    """A host export must be a memfd sealed against resizing: a file an exporter (or importer) can shrink kills
    every importer with SIGBUS. Any regular file of the right size used to pass."""
    a = books.client(1)
    fd = books.memfd(seals=seals)
    reply = books.ask(a, books.export_request(books.charge(a)), fd)
    assert (reply.code if isinstance(reply, P.Error) else 0) == code, reply
    if code:
        assert "seal" in reply.message and fd in books.closed  # type: ignore[attr-defined]


# ---------------------------------------------------------------- listings fit, whatever the node holds


def test_ls_pages_of_the_largest_listing_each_fit_a_frame_and_parse() -> None:
    """Every device and GPU with memory charged, a full trustlist and many importers: the listing's header used to
    be unbounded and its first row always included, so the page was cut at 64 KiB into invalid JSON."""
    books = Books(devices=1024, capacity=1 << 62)
    a = books.client(2_000_000_000, uid=1000)
    for d in range(1024):
        books.charge(a, (1 << 61) + d, device=d)
        books.charge(a, (1 << 63) - d, device=d, gpu=True)
    books.charge(a, (1 << 63), device=MAX_GPUS - 1, gpu=True)  # a GPU's sum beyond 64 bits
    trust = tuple(range(0x7FFFFFFF - 4095, 0x7FFFFFFF + 1))
    _, shareable, _, _ = books.export(a, flags=NO_PID_CHECK, pids=trust)
    for i in range(LIST_IMPORTERS + 3):
        assert books.imports(books.client(2_000_000_001 + i), shareable) == 0
    books.export(a)
    pages = _pages(books, books.client(2_100_000_000, uid=0))
    assert len(pages) > 2 and all(len(p["exports"]) + len(p["used"]) + len(p["gpu_used"]) <= LIST_PAGE
                                  for p in pages)
    used = {k: v for p in pages for k, v in p["used"].items()}
    gpus = {k: v for p in pages for k, v in p["gpu_used"].items()}
    rows = [r for p in pages for r in p["exports"]]
    assert len(used) == 1024 and len(gpus) == 1024 and len(rows) == 2
    assert gpus[str(MAX_GPUS - 1)] == (1 << 63) - (MAX_GPUS - 1) + (1 << 63)
    assert rows[0]["trustlist"] == list(trust)
    assert len(rows[0]["importers"]) == LIST_IMPORTERS and rows[0]["importer_count"] == LIST_IMPORTERS + 3
    assert {p["export_count"] for p in pages} == {2} and pages[0]["clients"] == LIST_IMPORTERS + 4


# ---------------------------------------------------------------- what the refusals say


def test_capacity_refusal_names_the_brokers_variable_and_how_to_change_it(books: Books) -> None:
    reply = books.ask(books.client(1), P.Charge(0, CAPACITY + 1))
    assert isinstance(reply, P.Error) and reply.code == NO_MEMORY
    for words in ("VMMSHARE_DEVICE_MEMORY", "when it started", "4242", "start it again"):
        assert words in reply.message, reply.message


def test_ls_counts_the_other_clients_not_the_one_asking(books: Books) -> None:
    a, b = books.client(1), books.client(2)
    assert _pages(books, a)[0]["clients"] == 1
    books.client(3)
    assert _pages(books, b)[0]["clients"] == 2
    assert json.loads(books.ledger.listing(0, books.ledger.connect(9, 1000, (None, 9))))["clients"] == 3


def test_unknown_handles_still_refuse_before_quotas(books: Books) -> None:
    assert books.code(books.client(1), P.SetPids(1234, DEFAULT, (5,))) == BAD_HANDLE
    assert books.code(books.client(2), P.Import(1234, DEFAULT, bytes(32))) == BAD_HANDLE
    assert books.code(books.client(3), P.Ok()) == IPC_ERROR


# ---------------------------------------------------------------- whom memory is charged to, as a property

USERS = (1000, 2000)
PROCS = 2  # processes of each user
UNITS = 4  # the memory quota, in MiB2


def _holders(books: Books, memory: Any) -> set[int]:
    """The users that hold `memory` now (its charge, or an import of it)."""
    return {held.client.uid for held in books.ledger.holds.values() if held.memory is memory}


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(steps=[("charge", 0, 0, 4), ("export", 0, 0, 1), ("import", 2, 0, 1), ("import", 1, 0, 1), ("free", 0, 0, 1),
                ("charge", 0, 0, 4)])  # the first round of the attack the search found
@given(st.lists(st.tuples(st.sampled_from(["charge", "export", "import", "free", "leave"]),
                          st.integers(0, len(USERS) * PROCS - 1), st.integers(0, 3), st.integers(1, UNITS)),
                max_size=40))
def test_quota_memory_a_user_still_reads_is_charged_to_it_whatever_the_sequence(
        steps: list[tuple[str, int, int, int]]) -> None:
    """Random allocations, exports (no pid validation), imports, frees and exits of two processes of each of two
    users (each step picks among the newest holds or exports: `pick` counts back), the books checked after every
    step: memory a user still holds stays charged to that user (the charge moves only once none of its processes
    holds it, and then to a user that chose to keep it alive by importing it); each user's tally is what is charged
    to it; and a charge is accepted exactly when what that user is charged for plus the new memory fits its quota.
    The books used to move the charge to the earliest remaining import when the allocating process freed, though a
    second process of the same user still read the memory: a user read past its quota and another user paid."""
    books = Books(quotas=Quotas(memory=UNITS * MiB2))
    procs = [books.client(10 + i, uid=USERS[i // PROCS]) for i in range(len(USERS) * PROCS)]
    shares: list[int] = []  # the values of exports made so far (revoked ones included)
    charged: dict[int, int] = {}  # id(memory) -> the uid charged for it after the last step
    for op, who, pick, units in steps:
        proc = procs[who]
        if proc not in books.ledger.clients:
            procs[who] = proc = books.client(proc.pid, uid=proc.uid)  # the process's successor connects
        holds = sorted(proc.holds)
        if op == "charge":
            mine = sum(m.size for m in {id(h.memory): h.memory for h in books.ledger.holds.values()}.values()
                       if m.charger.uid == proc.uid and m.device == 0)
            code = books.code(proc, P.Charge(0, units * MiB2))
            assert (code == 0) == (mine + units * MiB2 <= UNITS * MiB2), (
                f"uid {proc.uid} is charged {mine} bytes and asked for {units * MiB2}: {code}")
        elif op == "export" and holds:
            hold = holds[-1 - pick % len(holds)]
            size = books.ledger.holds[hold].memory.size
            reply = books.ask(proc, books.export_request(hold, flags=NO_PID_CHECK, size=size), books.memfd(size))
            if isinstance(reply, P.Exported):
                shares.append(int.from_bytes(reply.shareable, "little"))
        elif op == "import" and shares:
            books.imports(proc, shares[-1 - pick % len(shares)])  # refused once revoked
        elif op == "free" and holds:
            assert books.code(proc, P.Release(holds[-1 - pick % len(holds)])) == 0
        elif op == "leave":
            books.ledger.disconnect(proc)
        live = {id(h.memory): h.memory for h in books.ledger.holds.values()}
        for key, memory in live.items():
            holders = _holders(books, memory)
            payer = memory.charger.uid
            assert payer in holders, f"uid {payer} is charged for memory only uids {holders} hold"
            before = charged.get(key)
            assert before is None or before == payer or before not in holders, (
                f"the charge moved from uid {before}, which still holds the memory, to uid {payer}")
        charged = {key: memory.charger.uid for key, memory in live.items()}
        for uid in USERS:
            owed = sum(m.size for m in live.values() if m.charger.uid == uid and m.device == 0)
            tally = books.ledger.usage.users.get(uid)
            assert (tally.memory[0] if tally is not None else 0) == owed, f"uid {uid}'s tally is not its charges"
    for proc in procs:
        books.ledger.disconnect(proc)
    assert books.ledger.used == [0] * len(books.ledger.used) and not books.ledger.usage.users


def test_quota_memory_a_second_process_of_the_allocating_user_keeps_the_charge() -> None:
    """The sequence the property above found: a process of uid 1000 allocates its whole quota and exports it, a
    process of uid 2000 imports it, a second process of uid 1000 imports it, the first frees. The charge went to
    the earliest import (uid 2000's), so four rounds left uid 1000 reading four times its quota and uid 2000 unable
    to allocate. It stays with uid 1000, whose second round is refused."""
    books = Books(quotas=Quotas(memory=4 * MiB2))
    first, keeper, victim = books.client(1, uid=1000), books.client(2, uid=1000), books.client(3, uid=2000)
    hold, shareable, _, _ = books.export(first, flags=NO_PID_CHECK, size=4 * MiB2)
    assert books.imports(victim, shareable) == 0
    assert books.imports(keeper, shareable) == 0
    assert books.code(first, P.Release(hold)) == 0
    assert _held_memory(books, 1000) == 4 * MiB2 and _held_memory(books, 2000) == 0
    assert books.code(first, P.Charge(0, 4 * MiB2)) == NO_MEMORY, "a second round of the same"
    assert books.code(victim, P.Charge(0, 4 * MiB2)) == 0, "the other user's quota is its own"
    books.ledger.disconnect(keeper)
    assert _held_memory(books, 1000) == 0, "uid 1000 holds it no more"
    assert _held_memory(books, 2000) == 8 * MiB2, "the importer that kept it alive pays from then on"
