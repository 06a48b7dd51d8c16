"""Attacks on the hot path (docs/security.md): the broker serves an IMPORT or RELEASE of a connection's own process
straight from the frame's fields, the client reads IMPORTED and OK replies straight from one struct, the loop
groups a turn's connections by user, and the pyACL layer checks plain ints in one line. Each test plays the attacker
against a real broker process (or, for the client, a real process that lies like a broker): a frame that would take
the hot path but breaks the protocol, one with fds attached, one sent by another process on a passed connection, a
release of a hold that is not the connection's, interleaved requests with reused ids, one user flooding the broker
from many connections while another imports, and replies that are short, long or mismatched.

What a hot frame gets is what the full path gives the same frame: the refusals here are compared byte for byte with
the full codec's error for that frame, or with the ledger's text, and the books end as they began (the `broker`
fixture checks that)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import common as c
import identity as ident
import rawsock
from conftest import child_ok
from vmmshare.books.ledger import _not_the_owner
from vmmshare.books.records import Client
from vmmshare.client.connection import BrokerClient
from vmmshare.config import Config
from vmmshare.errors import AclError, InvalidParamError
from vmmshare.wire import local as P
from vmmshare.wire.props import check_int

IPC_ERROR, PARAM, BAD_HANDLE, NO_PERMISSION = c.IPC_ERROR, c.PARAM, c.BAD_HANDLE, c.NO_PERMISSION
MiB2 = c.MiB2
PROP_FIELDS = (0, 0, 5, 1, 0)  # handleType, allocationType, memAttr, location.type, location.id
UNKNOWN_HOLD = "unknown allocation token for this connection"


# ---------------------------------------------------------------- helpers


def export(conn: c.Raw, flags: int = c.NO_PID_CHECK) -> tuple[int, int]:
    """A 2 MiB sealed memfd charged and exported on `conn` (trustlist unchecked unless told): (hold, handle)."""
    fd = rawsock.sealed_memfd(MiB2, "vmmshare-hot-attack")
    token = conn.ask(P.Charge(0, MiB2))
    assert isinstance(token, P.Token), token
    conn.req += 1
    try:
        request = P.Export(token.hold, MiB2, flags, c.DEFAULT, 0, 0, *PROP_FIELDS, ())
        rawsock.send(conn.sock, P.encode(request, conn.req), (fd,))
    finally:
        os.close(fd)
    frame, fds = conn.recv()
    rawsock_close(fds)
    assert isinstance(frame.message, P.Exported), frame.message
    return token.hold, int.from_bytes(frame.message.shareable, "little")


def rawsock_close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def exchange(conn: c.Raw, packet: bytes, fds: tuple[int, ...] = ()) -> tuple[bytes, int]:
    """Send one raw packet; the raw reply and how many fds came with it (closed here)."""
    assert rawsock.send(conn.sock, packet, fds)
    data, got, _ = rawsock.recv(conn.sock)
    assert data is not None, "the broker closed the connection"
    rawsock_close(got)
    return data, len(got)


def import_frame(handle: int, req: int, share_type: int = c.DEFAULT, secret: bytes = bytes(32)) -> bytes:
    return P.HOT_IMPORT.struct.pack(P.HOT_IMPORT.start, req, P.HOT_IMPORT.length, handle, share_type, secret)


def release_frame(hold: int, req: int) -> bytes:
    return P.HOT_RELEASE.struct.pack(P.HOT_RELEASE.start, req, P.HOT_RELEASE.length, hold)


def error(code: int, text: str, req: int) -> bytes:
    return P.encode(P.Error(code, text), req)


def full_codecs_refusal(packet: bytes, nfds: int = 0) -> bytes:
    """The ERROR the full path sends for a frame its codec refuses (the broker's `_serve`)."""
    with pytest.raises(P.ProtocolError) as refused:
        P.decode(packet, nfds)
    return error(IPC_ERROR, f"protocol error: {refused.value}", P.peek_request_id(packet))


def imported_hold(reply: bytes, req: int) -> int:
    frame = P.decode(reply, 1)
    assert frame.req == req and isinstance(frame.message, P.Imported), frame
    return frame.message.hold


def alive(conn: c.Raw) -> None:
    """The connection is still served (a refusal is an answer, not a hang-up)."""
    assert isinstance(conn.ask(P.BareTgid()), P.Pid)


@pytest.fixture(params=["compiled", "pure"])
def hot_broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[c.BrokerProc]:
    """conftest's broker (its packets received in C), or one of the test's own whose packets go through pure
    Python: the hot path's gate (the sender's pid, no fd, not cut short) reads what either gives."""
    if request.param == "compiled":
        yield request.getfixturevalue("broker")
        return
    b = c.BrokerProc(tmp_path / "pure", env=c.clean_env(VMMSHARE_PURE_PYTHON="1"))
    try:
        yield b
    finally:
        b.kill()


@pytest.fixture
def pair(hot_broker: c.BrokerProc) -> Iterator[tuple[c.Raw, c.Raw, int, int]]:
    """An exporter and an importer connection of this process on the broker, and the export's charge hold and
    handle (its trustlist unchecked: any process may import it)."""
    with c.Raw(hot_broker.socket) as exporter, c.Raw(hot_broker.socket) as importer:
        charge, handle = export(exporter)
        yield exporter, importer, charge, handle


# ---------------------------------------------------------------- frames of a hot frame's size that break the protocol


def malformed(handle: int) -> list[bytes]:
    good_import, good_release = import_frame(handle, 21), release_frame(1, 22)
    imported = P.encode(P.Imported(1, MiB2, 0, *PROP_FIELDS), 23)
    return [
        b"VB\x01" + good_import[3:],  # another version
        b"VC" + good_import[2:],  # another protocol's magic
        good_import[:3] + b"\xff" + good_import[4:],  # an unknown type, IMPORT's size
        good_import[:8] + (40).to_bytes(4, "little") + good_import[12:],  # a length one short of the body
        good_import[:8] + (42).to_bytes(4, "little") + good_import[12:],  # one long
        good_import[:8] + (0xFFFFFFFF).to_bytes(4, "little") + good_import[12:],
        good_import + b"\0",  # a trailing byte, the header's length unchanged
        good_import[:8] + (42).to_bytes(4, "little") + good_import[12:] + b"\0",  # and the length saying so
        good_import[:-1],  # one byte short
        b"VB\x01" + good_release[3:],
        good_release[:8] + (9).to_bytes(4, "little") + good_release[12:] + b"\0",
        good_release + b"\0",
        good_release[:-1],
        good_release[:8] + (7).to_bytes(4, "little") + good_release[12:],
        imported[:-1],  # a reply's frame, cut
    ]


def test_hot_sized_frames_that_break_the_protocol_get_the_full_codecs_refusal(
        pair: tuple[c.Raw, c.Raw, int, int]) -> None:
    """Version, magic, type, length field, a trailing byte or one missing, at or next to IMPORT's and RELEASE's
    sizes: each is refused as the full codec refuses it, to its request id, with no fd, the connection kept and no
    hold taken or dropped."""
    exporter, importer, charge, handle = pair
    hold = imported_hold(exchange(importer, import_frame(handle, 9))[0], 9)
    for packet in [*malformed(handle), release_frame(charge, 24)[:4] + b"\x00" * 16]:
        reply, nfds = exchange(importer, packet)
        assert (reply, nfds) == (full_codecs_refusal(packet), 0), packet.hex()
    alive(importer)
    # requests of a hot frame's size and layout that are replies, not requests: the full path's words for it
    for kind in (P.Token(hold), P.Ok(), P.Pid(1), P.Mem(1, 2)):
        reply, nfds = exchange(importer, P.encode(kind, 31))
        assert (reply, nfds) == (error(IPC_ERROR, f"protocol error: {kind.TYPE.name} is a reply, not a request", 31),
                                 0)
    # the hold is the importer's still, once: nothing above released it
    assert exchange(importer, release_frame(hold, 40)) == (P.encode(P.Ok(), 40), 0)
    assert exchange(importer, release_frame(hold, 41)) == (error(BAD_HANDLE, UNKNOWN_HOLD, 41), 0)
    alive(exporter)


def test_a_hot_frame_with_fds_attached_is_refused_and_the_broker_keeps_none(
        hot_broker: c.BrokerProc, pair: tuple[c.Raw, c.Raw, int, int]) -> None:
    """An IMPORT or RELEASE that brings an fd (one, or more than a packet can carry) is not the owner's plain
    request: refused as the full path refuses it, nothing imported or released, every fd it brought closed."""
    exporter, importer, _charge, handle = pair
    hold = imported_hold(exchange(importer, import_frame(handle, 1))[0], 1)
    before = c.settled_fd_count(hot_broker)
    extra = [rawsock.sealed_memfd(4096, "vmmshare-hot-extra") for _ in range(8)]
    try:
        for packet, fds in ((import_frame(handle, 2), extra[:1]), (release_frame(hold, 3), extra[:1]),
                            (import_frame(handle, 4), extra[:2])):
            assert exchange(importer, packet, tuple(fds)) == (full_codecs_refusal(packet, len(fds)), 0)
        for packet in (import_frame(handle, 5), release_frame(hold, 6)):  # more fds than fit: cut short
            reply, nfds = exchange(importer, packet, tuple(extra))
            assert (reply, nfds) == (error(IPC_ERROR, f"protocol error: frame larger than {P.MAX_FRAME} bytes, or "
                                           "too many fds", P.peek_request_id(packet)), 0)
    finally:
        rawsock_close(extra)
    assert c.settled_fd_count(hot_broker) == before  # none of the fds sent is kept
    assert exchange(importer, release_frame(hold, 7)) == (P.encode(P.Ok(), 7), 0)
    assert exchange(importer, release_frame(hold, 8)) == (error(BAD_HANDLE, UNKNOWN_HOLD, 8), 0)
    alive(exporter)


# ---------------------------------------------------------------- holds that are not the connection's


def test_releases_of_holds_not_the_connections_are_refused_and_change_nothing(
        pair: tuple[c.Raw, c.Raw, int, int]) -> None:
    """A RELEASE of another connection's hold (of the same process: the pid is the same, the hold is not), of the
    exporter's charge, of a hold never taken, twice, with request ids 0 and reused: each refused in the ledger's
    words; the holds of others stay."""
    exporter, importer, charge, handle = pair
    hold = imported_hold(exchange(importer, import_frame(handle, 1))[0], 1)
    for asker, stolen, req in ((exporter, hold, 0), (importer, charge, 0), (importer, 0, 7), (importer, 2**64 - 1, 7),
                               (importer, hold + 1, 0xFFFFFFFF), (importer, hold - 1, 7)):
        assert exchange(asker, release_frame(stolen, req)) == (error(BAD_HANDLE, UNKNOWN_HOLD, req), 0)
    assert exchange(importer, release_frame(hold, 0)) == (P.encode(P.Ok(), 0), 0)
    assert exchange(importer, release_frame(hold, 0)) == (error(BAD_HANDLE, UNKNOWN_HOLD, 0), 0)
    # the exporter's charge stands: it still imports its own handle, and the importer may again
    again = imported_hold(exchange(importer, import_frame(handle, 2))[0], 2)
    assert exchange(importer, release_frame(again, 3)) == (P.encode(P.Ok(), 3), 0)
    assert exchange(exporter, release_frame(charge, 4)) == (P.encode(P.Ok(), 4), 0)  # the export goes with it
    gone = f"shareable handle {handle:#018x} is unknown on this node, or revoked (its exporter freed it or exited)"
    assert exchange(importer, import_frame(handle, 5)) == (error(BAD_HANDLE, gone, 5), 0)


def test_share_types_out_of_range_are_refused_on_the_hot_path(pair: tuple[c.Raw, c.Raw, int, int]) -> None:
    """IMPORT carries its share type in one byte: every value but the export's is refused (FABRIC's secret or not),
    with no hold taken."""
    _exporter, importer, _charge, handle = pair
    for share_type in (0, c.FABRIC, 3, 0x7F, 0xFF):
        for secret in (bytes(32), b"\xff" * 32):
            want = error(PARAM, f"shareable handle {handle:#018x} was exported with share type {c.DEFAULT}, not "
                         f"{share_type}", 9)
            assert exchange(importer, import_frame(handle, 9, share_type, secret)) == (want, 0)
    assert exchange(importer, import_frame(handle ^ (1 << 63), 10)) == (error(BAD_HANDLE, (
        f"shareable handle {handle ^ (1 << 63):#018x} is unknown on this node, or revoked (its exporter freed it or "
        "exited)"), 10), 0)
    # a DEFAULT import's secret is not looked at
    hold = imported_hold(exchange(importer, import_frame(handle, 11, c.DEFAULT, os.urandom(32)))[0], 11)
    assert exchange(importer, release_frame(hold, 12)) == (P.encode(P.Ok(), 12), 0)


def test_hot_and_full_requests_interleaved_with_reused_ids_are_answered_in_order(
        pair: tuple[c.Raw, c.Raw, int, int]) -> None:
    """Requests sent back to back without waiting, hot and full mixed, all under the same request ids: each reply
    answers its own request, in order, and the holds taken are exactly those imported and not released."""
    _exporter, importer, _charge, handle = pair
    script: list[tuple[bytes, type[P.Message]]] = []
    for req in (0, 5, 5, 0xFFFFFFFF):
        script += [(import_frame(handle, req), P.Imported), (P.encode(P.BareTgid(), req), P.Pid),
                   (import_frame(handle, req), P.Imported), (P.encode(P.MemInfo(0), req), P.Mem),
                   (release_frame(0, req), P.Error)]
    for packet, _ in script:
        assert rawsock.send(importer.sock, packet)
    holds: list[int] = []
    for packet, kind in script:
        data, fds, _ = rawsock.recv(importer.sock)
        assert data is not None
        frame = P.decode(data, len(fds))
        rawsock_close(fds)
        assert frame.req == P.peek_request_id(packet) and type(frame.message) is kind, (frame, kind)
        if isinstance(frame.message, P.Imported):
            holds.append(frame.message.hold)
    assert len(set(holds)) == 8
    for n, hold in enumerate(holds):
        assert exchange(importer, release_frame(hold, n)) == (P.encode(P.Ok(), n), 0)


# ---------------------------------------------------------------- a connection used by another process

PASSED_ON = """
    import json, os, socket, struct, sys
    fd, owner, frames = int(sys.argv[1]), int(sys.argv[2]), [bytes.fromhex(f) for f in sys.argv[3:]]
    sock = socket.socket(fileno=fd)
    sock.settimeout(30)
    out = {"pid": os.getpid()}
    try:  # claim the owner's pid in the credentials: only a privileged process may
        sock.sendmsg([frames[0]], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("iII", owner,
                                                                                          os.getuid(), os.getgid()))])
        out["forged"] = sock.recv(70000).hex()
    except PermissionError:
        out["forged"] = "EPERM"
    out["replies"] = []
    for frame in frames:
        sock.send(frame)
        data, anc, _, _ = sock.recvmsg(70000, socket.CMSG_SPACE(64))
        out["replies"].append([data.hex(), len(anc)])
    print(json.dumps(out), flush=True)
"""


def _passed_on(prefix: list[str], conn: c.Raw, frames: list[bytes]) -> dict[str, object]:
    """What a process that was handed `conn` gets for `frames` sent on it (a standard-library program)."""
    import json

    fd = conn.sock.fileno()
    out = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(PASSED_ON), str(fd), str(os.getpid()),
                          *(f.hex() for f in frames)], pass_fds=(fd,), env=c.clean_env(), capture_output=True,
                         text=True, timeout=c.HANG_GUARD, check=True)
    got: dict[str, object] = json.loads(out.stdout)
    return got


@pytest.mark.parametrize("who", ["same-user", "nobody"])
def test_a_connection_passed_to_another_process_imports_and_releases_nothing(
        pair: tuple[c.Raw, c.Raw, int, int], who: str) -> None:
    """The importer's connection handed to another process (of its user, or `nobody`, who could not even have
    connected): its IMPORT and RELEASE frames have the hot path's size and no fd, but the kernel stamps them with its
    own pid, so they are refused as the full path refuses them; `nobody` cannot claim the owner's pid either. The
    owner's hold is untouched."""
    prefix: list[str] = []
    if who == "nobody":
        other, why = ident.other_user()
        if other is None:
            pytest.skip(why)
        prefix = other
    _exporter, importer, charge, handle = pair
    hold = imported_hold(exchange(importer, import_frame(handle, 1))[0], 1)
    frames = [import_frame(handle, 2), release_frame(hold, 3), release_frame(charge, 4)]
    got = _passed_on(prefix, importer, frames)
    pid = got["pid"]
    assert isinstance(pid, int)
    owner = Client(os.getpid(), os.getuid(), (0, 0))
    refused = [[error(NO_PERMISSION, _not_the_owner(owner, pid), P.peek_request_id(f)).hex(), 0] for f in frames]
    assert got["replies"] == refused
    if who == "nobody":
        assert got["forged"] == "EPERM"
    else:  # root may claim any pid: that is the kernel's rule (uid 0 is trusted by the broker anyway)
        assert got["forged"] != "EPERM" or os.geteuid() != 0
        if got["forged"] != "EPERM":  # the forged IMPORT was the owner's: its hold is released below
            forged = P.decode(bytes.fromhex(str(got["forged"])), 1)
            assert isinstance(forged.message, P.Imported)
            assert exchange(importer, release_frame(forged.message.hold, 9)) == (P.encode(P.Ok(), 9), 0)
    assert exchange(importer, release_frame(hold, 5)) == (P.encode(P.Ok(), 5), 0)
    assert exchange(importer, release_frame(hold, 6)) == (error(BAD_HANDLE, UNKNOWN_HOLD, 6), 0)



# ---------------------------------------------------------------- one user floods, another imports

IMPORTER = """
    import os, socket, sys
    path, hello, ask = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(30)
    sock.connect(path)
    sock.send(hello)
    sock.recv(70000)
    print("connected", flush=True)
    sys.stdin.readline()
    sock.send(ask)
    print("sent", flush=True)
    data, anc, _, _ = sock.recvmsg(70000, socket.CMSG_SPACE(64))
    for level, kind, payload in anc:
        if kind == socket.SCM_RIGHTS:
            for at in range(0, len(payload) - len(payload) % 4, 4):
                os.close(int.from_bytes(payload[at:at + 4], "little"))
    print(data.hex(), flush=True)
    sys.stdin.readline()
"""


def test_a_flood_from_many_connections_of_one_user_does_not_keep_another_user_waiting() -> None:
    """One user (this process) has 16 connections with 32 IMPORTs queued on each when another user's (nobody's)
    one IMPORT arrives, all while the broker is stopped. A turn of the loop serves each user's ready connections one
    request each, within the user's quantum: so nobody's import is served within the first turn, after at most one
    import per connection of the flooding user. Hold ids count up in the order imports are served, so the order is
    read from them, not from a clock."""
    prefix, why = ident.other_user()
    if prefix is None:
        pytest.skip(why)
    world = ident.world_dir("vmmshare-hot-flood-")
    b = c.LoggedBroker(world / "run", "--multi-user", env=c.clean_env())
    flooders: list[c.Raw] = []
    other: subprocess.Popen[str] | None = None
    stopped = False
    try:
        exporter = c.Raw(b.socket)
        flooders.append(exporter)
        _charge, handle = export(exporter)
        flooders += [c.Raw(b.socket) for _ in range(16)]
        other = subprocess.Popen(
            [*prefix, sys.executable, "-c", textwrap.dedent(IMPORTER), str(b.socket),
             P.encode(P.BareTgid(), 1).hex(), import_frame(handle, 2).hex()],
            env=c.clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert other.stdin is not None and other.stdout is not None
        assert other.stdout.readline().strip() == "connected"
        alive(exporter)  # the broker has nothing left to do
        os.kill(b.pid, signal.SIGSTOP)
        stopped = True
        _, status = os.waitpid(b.pid, os.WUNTRACED)  # a signal is sent at once, but takes effect later
        assert os.WIFSTOPPED(status), status
        for conn in flooders[1:]:
            for req in range(1, 33):
                assert rawsock.send(conn.sock, import_frame(handle, req))
        other.stdin.write("go\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "sent"  # queued at the broker, with the flood
        os.kill(b.pid, signal.SIGCONT)
        stopped = False
        theirs = imported_hold(bytes.fromhex(other.stdout.readline().strip()), 2)
        ours: list[int] = []
        for conn in flooders[1:]:
            for req in range(1, 33):
                data, fds, _ = rawsock.recv(conn.sock)
                assert data is not None
                rawsock_close(fds)
                ours.append(imported_hold(data, req))
        before = sum(hold < theirs for hold in ours)
        assert before <= 16, f"{before} of the flood's 512 imports were served before the other user's one"
    finally:
        if stopped:
            os.kill(b.pid, signal.SIGCONT)
        for conn in flooders:
            conn.close()
        if other is not None:
            other.kill()
            other.wait(c.HANG_GUARD)
        b.kill()
        shutil.rmtree(world, ignore_errors=True)


# ---------------------------------------------------------------- a broker that lies in its hot replies

LIAR = """
    import json, os, socket, sys
    path, script = sys.argv[1], json.loads(sys.argv[2])  # [reply hex, fds to attach, request id patched in]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(4)
    print("ready", flush=True)
    while script:
        sock, _ = listener.accept()
        with sock:
            while script:
                request = sock.recv(70000)
                if not request:
                    break
                reply, nfds, patch = script.pop(0)
                reply = bytearray.fromhex(reply)
                if patch:
                    req = (int.from_bytes(request[4:8], "little") + patch - 1) & 0xFFFFFFFF
                    reply[4:8] = req.to_bytes(4, "little")
                fds = [os.memfd_create("vmmshare-liar") for _ in range(nfds)]
                for fd in fds:
                    os.ftruncate(fd, 2 << 20)
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, "little") for fd in fds))]
                sock.sendmsg([bytes(reply)], anc if fds else [])
                for fd in fds:
                    os.close(fd)
"""
GOOD = P.encode(P.Imported(7, MiB2, 0, *PROP_FIELDS), 0)
SAME = 1  # the reply names the request it answers
LIES: dict[str, tuple[str, bytes, int, int, str]] = {  # name: (request, reply, fds, request id, error)
    "imported-long": ("import", GOOD + b"\0", 1, SAME, "its header says"),
    "imported-long-length": ("import", GOOD[:8] + (26).to_bytes(4, "little") + GOOD[12:] + b"\0", 1, SAME,
                             "IMPORTED body of 26 bytes"),
    "imported-short": ("import", GOOD[:-1], 1, SAME, "its header says"),
    "imported-version": ("import", b"VB\x01" + GOOD[3:], 1, SAME, "version 1"),
    "imported-other-request": ("import", GOOD, 1, SAME + 1, "reply to request"),
    "imported-request-0": ("import", GOOD, 1, 0, "reply to request 0"),
    "imported-two-fds": ("import", GOOD, 2, SAME, "carries 1 file descriptor"),
    "imported-no-fd": ("import", GOOD, 0, SAME, "carries 1 file descriptor"),
    "imported-many-fds": ("import", GOOD, 9, SAME, "too large"),
    "ok-to-import": ("import", P.encode(P.Ok(), 0), 0, SAME, "OK in reply to IMPORT"),
    "refusal-with-fd": ("import", P.encode(P.Error(NO_PERMISSION, "no"), 0), 1, SAME, "file descriptor"),
    "refused-connection": ("import", P.encode(P.Error(NO_PERMISSION, "go away"), 0), 0, 0, "go away"),
    "ok-long": ("release", P.encode(P.Ok(), 0) + b"\0", 0, SAME, "its header says"),
    "ok-short": ("release", P.encode(P.Ok(), 0)[:-1], 0, SAME, "shorter than the 12-byte header"),
    "ok-with-fd": ("release", P.encode(P.Ok(), 0), 1, SAME, "carries 0 file descriptor"),
    "ok-other-request": ("release", P.encode(P.Ok(), 0), 0, SAME + 1, "reply to request"),
    "imported-to-release": ("release", GOOD, 1, SAME, "IMPORTED in reply to RELEASE"),
}


def liars_fds() -> int:
    """This process's fds that are the lying broker's memfds."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            count += "vmmshare-liar" in os.readlink(f"/proc/self/fd/{name}")
    return count


@pytest.mark.parametrize("lie", list(LIES))
def test_a_broker_that_lies_in_a_hot_reply_gets_a_clear_error_and_keeps_no_fd(
        lie: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process at the socket path answers an import (after one true answer, to have a hold to free) or a free
    with a reply of the hot frame's size give or take a byte, another version, another request's id, too many or too
    few fds, another type: the client raises an AclError that says what was wrong, keeps none of the fds that came,
    and drops the connection (a refusal of the connection also drops it; a refusal of a request would not)."""
    asked, reply, nfds, patch, why = LIES[lie]
    with lying_broker(tmp_path, monkeypatch, [[GOOD.hex(), 1, SAME], [reply.hex(), nfds, patch]]) as client:
        first = client.import_handle(5, c.DEFAULT, b"")
        os.close(first.fd)
        with pytest.raises(AclError, match=why):
            if asked == "import":
                client.import_handle(5, c.DEFAULT, b"")
            else:
                client.release(first.node_ref)
        assert liars_fds() == 0
        assert client._sock is None  # nothing more is read from that connection
        # the lie took no hold; a release lets go of its token whatever the answer
        assert client._holds == ({first.node_ref: 7} if asked == "import" else {})


@contextlib.contextmanager
def lying_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: list[list[object]]) -> Iterator[BrokerClient]:
    """A client of a process at the socket path that answers as `script` says (LIAR); it must have used up its
    script and exited by the end."""
    path = tmp_path / "run" / "broker.sock"
    path.parent.mkdir(mode=0o700)
    liar = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LIAR), str(path), json.dumps(script)],
                            env=c.clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert liar.stdout is not None and liar.stdout.readline().strip() == "ready"
        monkeypatch.setenv("VMMSHARE_SOCKET", str(path))
        client = BrokerClient(Config.from_env(), autostart=False)
        try:
            yield client
        finally:
            client.close()
        liar.wait(c.HANG_GUARD)
    finally:
        liar.kill()
        liar.wait(c.HANG_GUARD)


# ---------------------------------------------------------------- the pyACL layer's one-line int check


class Liar(int):
    """An int whose comparisons say it is in any range, and whose conversions say it is 1."""

    def __ge__(self, other: object) -> bool:
        return True

    def __le__(self, other: object) -> bool:
        return True

    def __int__(self) -> int:
        return 1

    def __index__(self) -> int:
        return 1


class Small(int):
    """A harmless int subclass (numpy-like scalars are not ints; an IntEnum member is one)."""


@pytest.mark.parametrize(("value", "lo", "hi", "kept"), [
    (5, 0, 10, 5), (0, 0, 0, 0), (-(1 << 31), -(1 << 31), 0, -(1 << 31)),
    ((1 << 64) - 1, 0, (1 << 64) - 1, (1 << 64) - 1),
    (Small(7), 0, 10, 7), (Liar(3), 0, 10, 3),
    (True, 0, 10, None), (False, 0, 10, None), (1.0, 0, 10, None), ("1", 0, 10, None), (None, 0, 10, None),
    (-1, 0, 10, None), (11, 0, 10, None), (1 << 64, 0, (1 << 64) - 1, None), (-(1 << 100), -(1 << 31), 0, None),
    (Small(11), 0, 10, None), (Liar(-5), 0, 10, None), (Liar(1 << 80), 0, (1 << 64) - 1, None),
], ids=repr)
def test_check_int_keeps_only_plain_values_in_range(value: object, lo: int, hi: int, kept: int | None) -> None:
    """In range, a plain int (or an int subclass's own value, as a plain int) comes back; a bool, a non-int, or a
    value outside the range, whatever an int subclass's comparisons or conversions claim, is InvalidParamError."""
    if kept is None:
        with pytest.raises(InvalidParamError):
            check_int("x", value, lo, hi)
        return
    got = check_int("x", value, lo, hi)
    assert type(got) is int and got == kept


def test_pyacl_calls_refuse_an_int_subclass_out_of_range_as_they_refuse_the_plain_int() -> None:
    """A value the caller's int subclass claims is in range reaches no allocation, mapping or broker request: each
    call answers as it does for the plain int (107000), where an out-of-range value that passed the check used to
    reach the runtime and come back as another error (207001, 107017, 100000)."""
    out = child_ok(f"""
        import json
        from vmmshare.acl import rt
        {textwrap.indent(textwrap.dedent(LIAR_SOURCE), ' ' * 8).strip()}
        rows = []
        for bad in (-4096, 1 << 70):
            rows.append([rt.malloc_physical(Liar(bad), P(), 0)[-1], rt.malloc_physical(bad, P(), 0)[-1]])
        rows.append([rt.reserve_mem_address(Liar(-2 * M), 0, 0, 0)[-1], rt.reserve_mem_address(-2 * M, 0, 0, 0)[-1]])
        rows.append([rt.mem_export_to_shareable_handle(Liar(-1), 0, 0)[-1],
                     rt.mem_export_to_shareable_handle(-1, 0, 0)[-1]])
        rows.append([rt.mem_import_from_shareable_handle_v2(5, 1, Liar(-3))[-1],
                     rt.mem_import_from_shareable_handle_v2(5, 1, -3)[-1]])
        print(json.dumps(rows))
    """)
    rows = json.loads(out.splitlines()[-2])
    assert rows == [[PARAM, PARAM]] * len(rows), rows


LIAR_SOURCE = """
    class Liar(int):
        def __ge__(self, other): return True
        def __le__(self, other): return True
        def __int__(self): return 1
        def __index__(self): return 1
"""


def test_a_default_handle_made_once_is_never_handed_to_a_bool_and_the_cache_stays_small() -> None:
    """The DEFAULT handle of a value is cached: True (== 1, and hashed alike) must still be refused after handle 1
    was imported, and a program that imports thousands of different handles keeps a bounded cache."""
    out = child_ok("""
        import json
        from vmmshare.acl import _share, rt
        first = rt.mem_import_from_shareable_handle(1, 0)[-1]
        as_bool = rt.mem_import_from_shareable_handle(True, 0)[-1]
        v2_bool = rt.mem_import_from_shareable_handle_v2(True, 1, 0)[-1]
        many = {rt.mem_import_from_shareable_handle(n, 0)[-1] for n in range(2, 3002)}
        print(json.dumps([first, as_bool, v2_bool, sorted(many), _share._default.cache_info().currsize]))
    """)
    first, as_bool, v2_bool, many, cached = json.loads(out.splitlines()[-2])
    assert first == BAD_HANDLE and many == [BAD_HANDLE]  # the broker's answer: no such export
    assert as_bool == v2_bool == PARAM
    assert cached <= 256


@pytest.mark.parametrize("values", [(1.5, c.DEFAULT), (1, 1.0), ("1", c.DEFAULT), (1, "1"), (None, c.DEFAULT),
                                    (1 << 64, c.DEFAULT), (-1, c.DEFAULT), (1, 256), (1, -1)], ids=repr)
def test_an_import_of_values_the_frame_cannot_carry_is_the_codecs_error_and_sends_nothing(
        values: tuple[object, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handle or share type that is not an int, or does not fit its field, is refused as the full codec refuses
    it (ProtocolError) before anything is sent: the one answer the (lying) broker has left is for the import that
    follows."""
    with lying_broker(tmp_path, monkeypatch, [[GOOD.hex(), 1, SAME]]) as client:
        with pytest.raises(P.ProtocolError):
            client.import_handle(*values, b"")  # type: ignore[arg-type]
        os.close(client.import_handle(5, c.DEFAULT, b"").fd)  # the liar's one answer is this import's
