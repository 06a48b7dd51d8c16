"""The broker's sharing rules on its ledger alone (SPEC §4 rules 2, 9–14, 16): no sockets, no processes.

`vmmshare.books.ledger` does no I/O, so every rule the broker enforces is a table here: requests from clients
that the test names (pid, uid and process identity as the kernel would have given them), fds as plain numbers,
and the exact reply or error code each must get. The same rules against a real broker and real processes are in
test_sharing_rules.py; raw clients that break them on purpose are in test_broker_robustness.py.
"""

from __future__ import annotations

import fcntl
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest

from vmmshare.books.ledger import LIST_IMPORTERS, LIST_PAGE, Client, Ledger, LedgerError
from vmmshare.books.records import Identity
from vmmshare.config import Quotas
from vmmshare.wire import local as P
from vmmshare.wire.handles import Endpoint, decode_fabric

MiB2 = 2 << 20
CAPACITY = 64 << 20
DEVICES = 8
PARAM = 107000
BAD_DEVICE = 107001
BAD_HANDLE = 107017
NO_MEMORY = 207001
NO_PERMISSION = 207006
IPC_ERROR = 507022
DEFAULT, FABRIC = 1, 2
NO_PID_CHECK = 1
HOST, GPU = 0, 1
PROP = (0, 0, 5, 1, 0)  # handleType, allocationType, memAttr, location type, location id
SERVER = 0x5EED
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # what an exported memfd must carry


class Books:
    """A ledger whose I/O is a table: the processes alive (pid -> identity), the fds handed to it and those it
    closed, the size of each memfd (None: not a regular file)."""

    def __init__(self, devices: int = DEVICES, capacity: int = CAPACITY, quotas: Quotas | None = None,
                 fd_budget: int | None = None) -> None:
        self.alive: dict[int, Identity] = {}
        self.sizes: dict[int, tuple[int, int] | None] = {}  # fd -> (size, seals) of a memfd; None: not a file
        self.closed: list[int] = []
        self.lookups: list[int] = []  # every pid looked up, in order
        self.failing: dict[int, OSError] = {}  # pid -> the error looking it up raises
        self._fds = itertools.count(1000)
        self.ledger = Ledger(devices, capacity, identify=self._identify, close_fd=self.closed.append,
                             memfd_info=self.sizes.__getitem__, broker_pid=4242, quotas=quotas, fd_budget=fd_budget)

    def _identify(self, pid: int) -> Identity:
        self.lookups.append(pid)
        if pid in self.failing:
            raise self.failing[pid]
        return self.alive.get(pid, (None, None))

    def client(self, pid: int, uid: int = 1000, identity: Identity | None = None) -> Client:
        """A process that connects now (a pidfs identity unless given)."""
        self.alive[pid] = identity if identity is not None else (None, 50_000 + pid)
        return self.ledger.connect(pid, uid, self.alive[pid])

    def memfd(self, size: int = MiB2, seals: int = SEALED) -> int:
        fd = next(self._fds)
        self.sizes[fd] = (size, seals)
        return fd

    def pipe(self) -> int:
        fd = next(self._fds)
        self.sizes[fd] = None
        return fd

    def ask(self, client: Client, request: P.Message, fd: int = -1) -> P.Message:
        reply, sent = self.ledger.handle(client, request, fd)
        assert (sent >= 0) == isinstance(reply, P.Imported), (reply, sent)
        return reply

    def code(self, client: Client, request: P.Message, fd: int = -1) -> int:
        """The error code `request` is refused with (0 when it is served)."""
        reply = self.ask(client, request, fd)
        if isinstance(reply, P.Error):
            assert reply.message.strip(), "an error says what was wrong"
            return reply.code
        return 0

    def charge(self, client: Client, size: int = MiB2, device: int = 0, gpu: bool = False) -> int:
        reply = self.ask(client, P.ChargeGpu(device, size) if gpu else P.Charge(device, size))
        assert isinstance(reply, P.Token), reply
        return reply.hold

    def export_request(self, hold: int, share_type: int = DEFAULT, flags: int = 0, pids: tuple[int, ...] = (),
                       size: int = MiB2, kind: int = HOST) -> P.Export:
        return P.Export(hold, size, flags, share_type, SERVER, kind, *PROP, pids)

    def export(self, client: Client, share_type: int = DEFAULT, flags: int = 0, pids: tuple[int, ...] = (),
               size: int = MiB2) -> tuple[int, int, bytes, int]:
        """Charge and export: (hold, shareable value, secret, the memfd the ledger now holds)."""
        hold = self.charge(client, size)
        fd = self.memfd(size)
        reply = self.ask(client, self.export_request(hold, share_type, flags, pids, size), fd)
        assert isinstance(reply, P.Exported), reply
        if share_type == FABRIC:
            fabric = decode_fabric(reply.shareable)
            return hold, fabric.handle, fabric.secret, fd
        return hold, int.from_bytes(reply.shareable, "little"), bytes(32), fd

    def imports(self, client: Client, shareable: int, share_type: int = DEFAULT, secret: bytes = bytes(32)) -> int:
        """The code an import gets (0: imported)."""
        return self.code(client, P.Import(shareable, share_type, secret))

    def free(self, device: int = 0) -> int:
        reply = self.ask(next(iter(self.ledger.clients)) if self.ledger.clients else self.client(1),
                         P.MemInfo(device))
        assert isinstance(reply, P.Mem) and reply.total == CAPACITY
        return reply.free


@pytest.fixture
def books() -> Books:
    return Books()


# ---------------------------------------------------------------- rule 2: node-wide capacity


CAPACITY_CASES = [
    # (id, [(client, device, size, gpu)], the code of each charge, free on device 0 afterwards)
    ("exactly_full", [(1, 0, CAPACITY, False)], [0], 0),
    ("one_byte_over", [(1, 0, CAPACITY + 1, False)], [NO_MEMORY], CAPACITY),
    ("full_then_one_byte", [(1, 0, CAPACITY, False), (1, 0, 1, False)], [0, NO_MEMORY], 0),
    ("shared_by_two_clients", [(1, 0, CAPACITY // 2, False), (2, 0, CAPACITY // 2 + 1, False)], [0, NO_MEMORY],
     CAPACITY // 2),
    ("devices_apart", [(1, 1, CAPACITY, False), (2, 0, CAPACITY, False)], [0, 0], 0),
    ("device_out_of_range", [(1, DEVICES, MiB2, False), (1, -2, MiB2, False)], [BAD_DEVICE, BAD_DEVICE], CAPACITY),
    ("host_memory_is_not_capped", [(1, -1, 4 * CAPACITY, False)], [0], CAPACITY),
    ("gpu_memory_is_recorded_not_capped", [(1, 0, 4 * CAPACITY, True)], [0], CAPACITY),
    ("gpu_id_out_of_range", [(1, 1024, MiB2, True), (1, 1023, MiB2, True)], [BAD_DEVICE, 0], CAPACITY),
]


@pytest.mark.parametrize(("charges", "codes", "free"), [c[1:] for c in CAPACITY_CASES],
                         ids=[c[0] for c in CAPACITY_CASES])
def test_rule_2_capacity_is_node_wide(books: Books, charges: list[tuple[int, int, int, bool]], codes: list[int],
                                      free: int) -> None:
    clients: dict[int, Client] = {}
    got = []
    for pid, device, size, gpu in charges:
        client = clients.setdefault(pid, books.client(pid))
        got.append(books.code(client, P.ChargeGpu(device, size) if gpu else P.Charge(device, size)))
    assert got == codes
    assert books.free() == free
    assert books.code(next(iter(clients.values())), P.MemInfo(DEVICES)) == BAD_DEVICE


def test_rule_2_release_and_disconnect_give_capacity_back(books: Books) -> None:
    a, b = books.client(1), books.client(2)
    hold = books.charge(a, CAPACITY // 2)
    books.charge(b, CAPACITY // 2)
    gpu = books.charge(a, 3 * MiB2, device=5, gpu=True)
    assert books.free() == 0 and books.ledger.gpu_used[5] == 3 * MiB2
    assert books.code(a, P.Release(hold)) == 0
    assert books.free() == CAPACITY // 2
    books.ledger.disconnect(b)
    assert books.free() == CAPACITY
    assert books.code(a, P.Release(gpu)) == 0 and books.ledger.gpu_used[5] == 0
    assert not books.ledger.holds


# ---------------------------------------------------------------- rules 9 and 10: what exports, once


@pytest.mark.parametrize(("first", "second"), [(DEFAULT, DEFAULT), (DEFAULT, FABRIC), (FABRIC, DEFAULT),
                                               (FABRIC, FABRIC)])
def test_rule_9_a_handle_exports_once_whatever_the_share_type(books: Books, first: int, second: int) -> None:
    a = books.client(1)
    hold, _, _, _ = books.export(a, first, NO_PID_CHECK)
    fd = books.memfd()
    assert books.code(a, books.export_request(hold, second, NO_PID_CHECK), fd) == PARAM
    assert fd in books.closed, "a refused export's fd is let go"
    assert len(books.ledger.exports) == 1


EXPORT_CASES = [
    # (id, flags, share type, memory kind of the request, fd kind, size in the request, expected code)
    ("default", 0, DEFAULT, HOST, "memfd", MiB2, 0),
    ("fabric_no_pid_check", 1, FABRIC, HOST, "memfd", MiB2, 0),
    ("flags_2", 2, DEFAULT, HOST, "memfd", MiB2, PARAM),
    ("flags_255", 255, DEFAULT, HOST, "memfd", MiB2, PARAM),
    ("share_type_0", 0, 0, HOST, "memfd", MiB2, PARAM),
    ("share_type_3", 0, 3, HOST, "memfd", MiB2, PARAM),
    ("gpu_kind_for_host_memory", 0, DEFAULT, GPU, "memfd", MiB2, PARAM),
    ("a_pipe_as_memory", 0, DEFAULT, HOST, "pipe", MiB2, PARAM),
    ("a_memfd_of_another_size", 0, DEFAULT, HOST, "big_memfd", MiB2, PARAM),
    ("a_size_that_is_not_the_charge", 0, DEFAULT, HOST, "big_memfd", 2 * MiB2, PARAM),
    ("no_fd", 0, DEFAULT, HOST, "none", MiB2, PARAM),
]


@pytest.mark.parametrize(("flags", "share_type", "kind", "fd_kind", "size", "code"), [c[1:] for c in EXPORT_CASES],
                         ids=[c[0] for c in EXPORT_CASES])
def test_rule_10_export_flags_share_type_and_memory_are_checked(books: Books, flags: int, share_type: int, kind: int,
                                                                fd_kind: str, size: int, code: int) -> None:
    a = books.client(1)
    hold = books.charge(a)
    make: dict[str, Callable[[], int]] = {"memfd": books.memfd, "big_memfd": lambda: books.memfd(2 * MiB2),
                                          "pipe": books.pipe, "none": lambda: -1}
    fd = make[fd_kind]()
    assert books.code(a, books.export_request(hold, share_type, flags, size=size, kind=kind), fd) == code
    assert (fd in books.closed) == (code != 0 and fd >= 0), "the fd is kept exactly when the export is"
    assert len(books.ledger.exports) == (code == 0)


def test_rule_10_gpu_memory_exports_as_gpu_memory_only(books: Books) -> None:
    """The broker cannot look inside a GPU allocation's fd: the kind must be the one charged."""
    a = books.client(1)
    gpu = books.charge(a, gpu=True)
    assert books.code(a, books.export_request(gpu, kind=HOST), books.memfd()) == PARAM
    assert books.code(a, books.export_request(gpu, kind=GPU), books.pipe()) == 0  # any fd: the driver checks it


def test_rule_10_only_the_charging_client_exports_and_an_import_does_not(books: Books) -> None:
    a, b = books.client(1), books.client(2)
    hold = books.charge(a)
    assert books.code(b, books.export_request(hold), books.memfd()) == BAD_HANDLE  # another client's hold
    assert books.code(a, books.export_request(hold ^ 2), books.memfd()) == BAD_HANDLE  # no such hold
    _, shareable, _, _ = books.export(a, flags=NO_PID_CHECK)
    assert books.imports(b, shareable) == 0
    imported = next(iter(b.holds))
    assert books.code(b, books.export_request(imported), books.memfd()) == PARAM  # an imported handle


# ---------------------------------------------------------------- rules 11 and 12: trustlists


def test_rule_11_default_export_imports_only_on_the_trustlist(books: Books) -> None:
    a, listed, other = books.client(1), books.client(2), books.client(3)
    _, shareable, _, _ = books.export(a, pids=(2,))
    assert books.imports(other, shareable) == NO_PERMISSION
    assert books.imports(listed, shareable) == 0


@pytest.mark.parametrize("share_type", [DEFAULT, FABRIC])
def test_rule_11_disable_pid_validation_lets_anyone_import(books: Books, share_type: int) -> None:
    a, anyone = books.client(1), books.client(77, uid=2000)
    _, shareable, secret, _ = books.export(a, share_type, NO_PID_CHECK)
    assert books.imports(anyone, shareable, share_type, secret) == 0


def test_rule_12_only_the_exporter_sets_the_trustlist(books: Books) -> None:
    a, b = books.client(1), books.client(2)
    _, shareable, _, _ = books.export(a)
    assert books.code(b, P.SetPids(shareable, DEFAULT, (2,))) == NO_PERMISSION
    assert books.imports(b, shareable) == NO_PERMISSION, "the refused call added nothing"
    assert books.code(a, P.SetPids(shareable, DEFAULT, (2,))) == 0
    assert books.imports(b, shareable) == 0


TRUSTLIST_CASES = [
    # (id, pids set at export, pids of each later call, code of each call, trustlist size afterwards)
    ("positive_pids", (5,), [(6, 0x7FFFFFFF)], [0], 3),
    ("pid_0", (), [(0,)], [PARAM], 0),
    ("pid_over_i32", (), [(0x80000000,)], [PARAM], 0),
    ("pid_u32_max", (), [(5, 0xFFFFFFFF)], [PARAM], 0),
    ("calls_add", (1,), [(2,), (3, 4)], [0, 0], 4),
    ("4096_at_once", (), [tuple(range(1, 4097))], [0], 4096),
    ("4097_at_once", (), [tuple(range(1, 4098))], [PARAM], 0),
    ("4096_then_one_more", (), [tuple(range(1, 4097)), (5000,)], [0, PARAM], 4096),
    ("4096_then_one_again", (), [tuple(range(1, 4097)), (7,)], [0, 0], 4096),
    ("4000_then_97_new", tuple(range(1, 4001)), [tuple(range(4001, 4098))], [PARAM], 4000),
]


@pytest.mark.parametrize(("initial", "calls", "codes", "size"), [c[1:] for c in TRUSTLIST_CASES],
                         ids=[c[0] for c in TRUSTLIST_CASES])
def test_rule_12_pids_are_positive_32_bit_ints_at_most_4096_added_by_each_call(
        books: Books, initial: tuple[int, ...], calls: list[tuple[int, ...]], codes: list[int], size: int) -> None:
    a = books.client(1)
    _, shareable, _, _ = books.export(a, pids=initial)
    assert [books.code(a, P.SetPids(shareable, DEFAULT, pids)) for pids in calls] == codes
    assert len(books.ledger.exports[shareable].trust) == size


def test_rule_12_a_trustlist_set_at_export_is_checked_too(books: Books) -> None:
    a = books.client(1)
    hold = books.charge(a)
    fd = books.memfd()
    assert books.code(a, books.export_request(hold, pids=(0,)), fd) == PARAM
    assert fd in books.closed and not books.ledger.exports


IDENTITY_CASES = [
    # (id, identity of the pid's process at trustlist time, identity of the importer with that pid, code)
    ("same_process_pidfs", (None, 7001), (None, 7001), 0),
    ("pid_reused_pidfs", (None, 7001), (None, 7002), NO_PERMISSION),
    ("same_process_start_time", (1234, None), (1234, None), 0),
    ("pid_reused_start_time", (1234, None), (1299, None), NO_PERMISSION),
    ("nobody_had_the_pid", (None, None), (None, 7002), 0),  # bound to nothing: whoever gets the pid imports
]


@pytest.mark.parametrize(("bound", "importer", "code"), [c[1:] for c in IDENTITY_CASES],
                         ids=[c[0] for c in IDENTITY_CASES])
def test_rule_12_a_trustlisted_pid_is_bound_to_its_process(books: Books, bound: Identity, importer: Identity,
                                                           code: int) -> None:
    a = books.client(1)
    if bound != (None, None):
        books.alive[9] = bound  # pid 9 is this process when the exporter trusts it
    _, shareable, _, _ = books.export(a, pids=(9,))
    later = books.client(9, identity=importer)  # whoever has pid 9 when it imports
    assert books.imports(later, shareable) == code


# ---------------------------------------------------------------- rule 13: the exporter imports its own handle


@pytest.mark.parametrize("share_type", [DEFAULT, FABRIC])
def test_rule_13_the_exporter_imports_its_own_handle(books: Books, share_type: int) -> None:
    """The exporter's own connection needs no trustlist entry; any other connection (even of the same process)
    is judged by the trustlist; the self-import's release does not revoke the export."""
    a = books.client(1)
    hold, shareable, secret, _ = books.export(a, share_type)
    assert books.imports(a, shareable, share_type, secret) == 0
    second_connection = books.ledger.connect(1, 1000, a.identity)  # the same process, connected twice
    assert books.imports(second_connection, shareable, share_type, secret) == NO_PERMISSION
    assert not second_connection.holds and len(a.holds) == 2
    (own,) = a.holds - {hold}
    assert books.code(a, P.Release(own)) == 0
    assert books.imports(a, shareable, share_type, secret) == 0, "releasing the self-import revoked the export"


# ---------------------------------------------------------------- rule 14: revocation


@pytest.mark.parametrize("how", ["release", "disconnect", "revoke"])
def test_rule_14_exporter_free_revokes_but_importers_keep_their_memory(books: Books, how: str) -> None:
    a, b, late = books.client(1), books.client(2), books.client(3)
    hold, shareable, _, fd = books.export(a, flags=NO_PID_CHECK)
    assert books.imports(b, shareable) == 0
    (imported,) = b.holds
    if how == "release":
        assert books.code(a, P.Release(hold)) == 0
    elif how == "disconnect":
        books.ledger.disconnect(a)
    else:
        assert books.code(a, P.Revoke(hold)) == 0
        assert books.code(a, P.Revoke(hold)) == 0  # again: nothing more to do
    assert books.closed == [fd], "the export's fd is closed once, at revocation"
    assert books.imports(late, shareable) == BAD_HANDLE
    assert books.free() == CAPACITY - MiB2, "the importer still holds the memory"
    assert books.code(b, P.Release(imported)) == 0
    assert books.free() == (CAPACITY if how != "revoke" else CAPACITY - MiB2)


def test_rule_14_only_the_exporter_revokes(books: Books) -> None:
    a, b, c = books.client(1), books.client(2), books.client(3)
    _, shareable, _, fd = books.export(a, flags=NO_PID_CHECK)
    assert books.imports(b, shareable) == 0
    (imported,) = b.holds
    assert books.code(b, P.Revoke(imported)) == NO_PERMISSION
    assert books.code(c, P.Revoke(imported)) == BAD_HANDLE
    assert fd not in books.closed and books.imports(c, shareable) == 0


def test_rule_14_an_importer_leaving_revokes_nothing(books: Books) -> None:
    a, b, c = books.client(1), books.client(2), books.client(3)
    hold, shareable, _, fd = books.export(a, flags=NO_PID_CHECK)
    assert books.imports(b, shareable) == 0
    books.ledger.disconnect(b)
    assert books.imports(c, shareable) == 0
    assert fd not in books.closed
    assert books.code(a, P.Release(hold)) == 0
    assert books.free() == CAPACITY - MiB2  # c holds it
    books.ledger.disconnect(c)
    assert books.free() == CAPACITY and not books.ledger.holds and books.closed == [fd]


# ---------------------------------------------------------------- rule 16 and the share type at import


IMPORT_CASES: list[tuple[str, Callable[[int, bytes], tuple[int, int, bytes]], int, int]] = [
    # (id, what the importer sends given the export's value and secret, exported as, expected code)
    ("default_as_default", lambda v, s: (v, DEFAULT, bytes(32)), DEFAULT, 0),
    ("fabric_as_fabric", lambda v, s: (v, FABRIC, s), FABRIC, 0),
    ("fabric_as_default", lambda v, s: (v, DEFAULT, bytes(32)), FABRIC, PARAM),
    ("fabric_as_default_with_its_secret", lambda v, s: (v, DEFAULT, s), FABRIC, PARAM),
    ("default_as_fabric", lambda v, s: (v, FABRIC, bytes(32)), DEFAULT, PARAM),
    ("fabric_without_its_secret", lambda v, s: (v, FABRIC, bytes(32)), FABRIC, BAD_HANDLE),
    ("fabric_with_a_wrong_secret", lambda v, s: (v, FABRIC, bytes([s[0] ^ 1]) + s[1:]), FABRIC, BAD_HANDLE),
    ("unknown_value", lambda v, s: (v ^ 1 << 40, DEFAULT, bytes(32)), DEFAULT, BAD_HANDLE),
    ("zero", lambda v, s: (0, DEFAULT, bytes(32)), DEFAULT, BAD_HANDLE),
    ("unknown_fabric", lambda v, s: (v ^ 1 << 40, FABRIC, s), FABRIC, BAD_HANDLE),
]


@pytest.mark.parametrize(("send", "exported_as", "code"), [c[1:] for c in IMPORT_CASES],
                         ids=[c[0] for c in IMPORT_CASES])
def test_rule_16_an_import_is_checked_against_its_export(books: Books, send: Callable[[int, bytes], Any],
                                                         exported_as: int, code: int) -> None:
    """Unknown values are 107017; a handle imported as another share type than it was exported with is 107000
    (a FABRIC export reached by its 64-bit value as a DEFAULT handle would skip its secret); a FABRIC import
    must carry the handle's secret (107017)."""
    a, b = books.client(1), books.client(2)
    _, value, secret, _ = books.export(a, exported_as, NO_PID_CHECK)
    reply, fd = books.ledger.handle(b, P.Import(*send(value, secret)))
    assert (reply.code if isinstance(reply, P.Error) else 0) == code
    assert (fd >= 0) == (code == 0) and bool(b.holds) == (code == 0)


def test_rule_16_set_pids_checks_the_handle_like_an_import(books: Books) -> None:
    a = books.client(1)
    _, value, _, _ = books.export(a, FABRIC)
    assert books.code(a, P.SetPids(value ^ 1 << 40, FABRIC, (5,))) == BAD_HANDLE
    assert books.code(a, P.SetPids(value, DEFAULT, (5,))) == PARAM
    assert books.code(a, P.SetPids(value, FABRIC, (5,))) == 0


# ---------------------------------------------------------------- holds belong to their client


@pytest.mark.parametrize("request_of", [P.Release, P.Revoke], ids=["release", "revoke"])
def test_a_hold_is_its_clients_alone(books: Books, request_of: Callable[[int], P.Message]) -> None:
    a, b = books.client(1), books.client(2)
    hold = books.charge(a, CAPACITY)
    assert books.code(b, request_of(hold)) == BAD_HANDLE
    assert books.code(a, request_of(hold ^ 2)) == BAD_HANDLE
    assert books.free() == 0, "nothing was released"
    assert books.code(a, P.Release(hold)) == 0
    assert books.code(a, P.Release(hold)) == BAD_HANDLE  # released already


def test_replies_sent_as_requests_are_refused_and_their_fds_closed(books: Books) -> None:
    a = books.client(1)
    fd = books.pipe()
    reply = books.ask(a, P.Imported(1, MiB2, 0, *PROP), fd)
    assert isinstance(reply, P.Error) and reply.code == IPC_ERROR
    assert books.closed == [fd]
    for message in (P.Ok(), P.Error(1, "x"), P.Token(1), P.Mem(1, 1), P.Exported(bytes(8)), P.Pid(1),
                    P.Listing("{}")):
        assert books.code(a, message) == IPC_ERROR


def test_a_stray_fd_on_a_request_that_takes_none_is_closed(books: Books) -> None:
    a = books.client(1)
    fd = books.pipe()
    assert books.code(a, P.Charge(0, MiB2), fd) == 0
    assert books.closed == [fd]


def test_bare_tgid_is_the_pid_the_kernel_gave(books: Books) -> None:
    assert books.ask(books.client(31337), P.BareTgid()) == P.Pid(31337)


# ---------------------------------------------------------------- the listing


def _pages(books: Books, viewer: Client) -> list[dict[str, Any]]:
    pages: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        reply = books.ask(viewer, P.List(offset))
        assert isinstance(reply, P.Listing)
        assert len(reply.page.encode()) <= P.MAX_BODY, "a page fits one frame"
        pages.append(json.loads(reply.page))
        offset = pages[-1]["next"]
        assert len(pages) < 1000
    return pages


def test_listing_pages_are_bounded_and_list_every_export_once() -> None:
    """Rows are cut into pages by bytes (each page fits a frame) and by count (LIST_PAGE rows at most)."""
    books = Books(capacity=1 << 40)
    a = books.client(1, uid=1000)
    big = [tuple(range(10_000 * i + 1, 10_000 * i + 1501)) for i in range(8)]  # about 84 kB of trustlists
    values = [books.export(a, pids=pids)[1] for pids in big]
    values += [books.export(a)[1] for _ in range(LIST_PAGE + 20)]
    pages = _pages(books, books.client(2, uid=1000))  # the viewer's own connection is not counted in "clients"
    sizes = [len(p["exports"]) for p in pages]
    assert len(pages) >= 3 and max(sizes) == LIST_PAGE and sizes[0] < 8, sizes  # both bounds bit
    rows = [row for p in pages for row in p["exports"]]
    assert [r["handle"] for r in rows] == [f"{v:#018x}" for v in values]
    assert [r["trustlist"] for r in rows[:8]] == [list(pids) for pids in big]
    assert {r["owner_pid"] for r in rows} == {1}
    head = pages[0]
    assert head["broker_pid"] == 4242 and head["capacity"] == 1 << 40 and head["clients"] == 1
    assert head["used"] == {"0": len(values) * MiB2}


def test_listing_hides_handle_values_from_other_users_and_caps_importers(books: Books) -> None:
    a = books.client(1, uid=1000)
    _, value, _, _ = books.export(a, flags=NO_PID_CHECK)
    for pid in range(2, LIST_IMPORTERS + 7):
        assert books.imports(books.client(pid), value) == 0
    (row,) = _pages(books, books.client(99_999, uid=2000))[0]["exports"]
    assert row["handle"] == "(hidden)"
    assert len(row["importers"]) == LIST_IMPORTERS and row["importer_count"] == LIST_IMPORTERS + 5
    assert _pages(books, books.client(99_998, uid=0))[0]["exports"][0]["handle"] == f"{value:#018x}"
    assert _pages(books, books.client(99_997, uid=1000))[0]["exports"][0]["handle"] == f"{value:#018x}"


# ---------------------------------------------------------------- rules 11-13 and 17 for importers of other servers

OTHER = 0xB0B  # another server's id
ENDPOINT = Endpoint(4, "10.77.0.1", 17017)


def fabric_books() -> Books:
    """Books of a node with the cross-server transport on (its FABRIC handles carry its endpoint)."""
    books = Books()
    books.ledger.endpoint = ENDPOINT
    return books


def remote(books: Books, pid: int, server: int = OTHER) -> Client:
    """An importer of another server, as its own broker names it to this one."""
    return books.ledger.connect(pid, 1000, (None, None), server=server)


def admit_code(books: Books, client: Client, shareable: int, secret: bytes) -> int:
    try:
        books.ledger.admit(client, shareable, FABRIC, secret)
    except LedgerError as exc:  # the code the remote importer's broker passes on
        return exc.code
    return 0


@pytest.mark.parametrize("v2_pids, pairs, importer_pid, importer_server, code", [
    ((), (), 77, OTHER, NO_PERMISSION),  # on no list
    ((77,), (), 77, OTHER, 0),  # a V2 trustlist pid admits that pid from any server (its broker vouches for it)
    ((), ((OTHER, 77),), 77, OTHER, 0),  # a (server, pid) pair admits that server's pid
    ((), ((OTHER, 77),), 77, 0xC0C, NO_PERMISSION),  # ... and only that server's
    ((), ((OTHER, 77),), 78, OTHER, NO_PERMISSION),
])
def test_rule_11_importers_of_other_servers_are_admitted_by_the_trustlist(
    v2_pids: tuple[int, ...], pairs: tuple[tuple[int, int], ...], importer_pid: int, importer_server: int, code: int,
) -> None:
    books = fabric_books()
    exporter = books.client(10)
    _, value, secret, _ = books.export(exporter, FABRIC, pids=v2_pids)
    for server, pid in pairs:
        assert books.code(exporter, P.SetRemotePids(value, FABRIC, server, (pid,))) == 0
    assert admit_code(books, remote(books, importer_pid, importer_server), value, secret) == code


def test_rule_12_only_the_exporter_trusts_other_servers_processes() -> None:
    books = fabric_books()
    exporter, other = books.client(10), books.client(11)
    _, value, _, _ = books.export(exporter, FABRIC)
    assert books.code(other, P.SetRemotePids(value, FABRIC, OTHER, (77,))) == NO_PERMISSION
    assert books.code(exporter, P.SetRemotePids(value, FABRIC, OTHER, (0,))) == PARAM
    assert books.code(exporter, P.SetRemotePids(value, FABRIC, OTHER, (77,))) == 0


def test_rule_17_other_servers_processes_need_the_transport(books: Books) -> None:
    exporter = books.client(10)
    _, value, _, _ = books.export(exporter, FABRIC)
    assert books.code(exporter, P.SetRemotePids(value, FABRIC, OTHER, (77,))) == 207000


def test_rule_13_a_remote_importer_with_the_exporters_pid_is_another_process() -> None:
    """Pids are per server: pid 10 of another server is not the exporting process, pid 10 here."""
    books = fabric_books()
    exporter = books.client(10)
    _, value, secret, _ = books.export(exporter, FABRIC, flags=NO_PID_CHECK)
    assert admit_code(books, remote(books, 10), value, secret) == 0
    assert books.imports(books.client(12), value, FABRIC, secret) == 0
    assert admit_code(books, remote(books, 11), value, bytes(32)) == BAD_HANDLE  # rule 16: the secret


def test_rule_14_a_remote_hold_outlives_the_export_and_releases_like_a_local_one() -> None:
    books = fabric_books()
    exporter = books.client(10)
    _, value, secret, fd = books.export(exporter, FABRIC, flags=NO_PID_CHECK)
    importer = remote(books, 77)
    hold, _ = books.ledger.admit(importer, value, FABRIC, secret)
    books.ledger.disconnect(exporter)  # the exporter dies: revoked, its fd let go
    assert fd in books.closed and books.free() == CAPACITY - MiB2  # the remote importer still holds the memory
    assert admit_code(books, remote(books, 78), value, secret) == BAD_HANDLE
    books.ledger.release(importer, hold)
    assert books.free() == CAPACITY


def test_a_refusal_of_the_book_is_an_acl_error_with_its_code_and_message() -> None:
    """The book's refusals travel up as every runtime error does: an AclError carrying `.code` and `.message`."""
    from vmmshare.errors import AclError, error_from_code

    books = Books(quotas=Quotas(connections=1))
    books.client(100)
    with pytest.raises(AclError) as caught:
        books.client(101)
    exc = caught.value
    assert isinstance(exc, LedgerError)
    assert exc.code == 207005 and "VMMSHARE_QUOTA_CONNECTIONS" in exc.message
    assert str(exc) == str(error_from_code(exc.code, exc.message))
