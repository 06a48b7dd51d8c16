"""The exporter's own paths: what each way a reply can go wrong, and each bad argument, must give.

`BrokerClient.export` writes out `request`/`_locked`/`_exchange` itself; these tests drive it against a scripted
broker (a real SOCK_SEQPACKET listener) through every way a reply can go wrong, and `Device.allocate`'s one-pass
path (`Vmm.allocate_rounded`, `Device._prop` built by the cached `prop_of`) against a real broker, checking the codes
and that nothing is left charged or exported behind an error.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import vmmshare
import vmmshare.client.connection as connection
from conftest import ACL_PARAM, NOT_SUPPORTED, PARAM, MiB
from vmmshare._process import runtime
from vmmshare.client.connection import RETRIES, BrokerClient
from vmmshare.config import Config
from vmmshare.errors import AclError, IpcError
from vmmshare.wire import local as P
from vmmshare.wire.props import prop_of

IPC = 507022
HANDLE = b"\x05" + bytes(7)


def null_fds() -> int:
    """Open descriptors of /dev/null in this process: the fds the scripted broker attaches to its replies."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/null":
                n += 1
        except OSError:
            pass
    return n


class ScriptedBroker:
    """A listener that answers CHARGE with a fresh hold per connection and each EXPORT by the next step of a script;
    it records every request it decodes (type, request id, message, fds attached)."""

    def __init__(self, path: Path, script: list[str]) -> None:
        self.path, self.script, self.seen = path, list(script), []  # type: ignore[var-annotated]
        self.connections = 0
        self.attached = os.open("/dev/null", os.O_RDONLY)  # what a reply carries: ours, open until close()
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.srv.bind(str(path))
        self.srv.listen(8)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.srv.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.srv.close()
        self.thread.join(5)
        os.close(self.attached)

    def _send(self, conn: socket.socket, frame: bytes, with_fd: bool = False) -> None:
        if not with_fd:
            conn.sendmsg([frame])
            return
        conn.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.attached]))])

    def _run(self) -> None:
        while self.script:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.connections += 1
            hold = 100 * self.connections
            with conn:
                while self.script:
                    try:
                        data, anc, _, _ = conn.recvmsg(1 << 17, socket.CMSG_SPACE(64))
                    except OSError:
                        break
                    fds: list[int] = []
                    for _level, _type, raw in anc:
                        got = array.array("i")
                        got.frombytes(raw[: len(raw) - len(raw) % 4])
                        fds += list(got)
                    for fd in fds:
                        os.close(fd)
                    if not data:
                        break
                    req, msg = P.decode(data, len(fds))
                    self.seen.append((type(msg).__name__, req, msg, len(fds)))
                    if isinstance(msg, P.Charge):
                        self._send(conn, P.encode(P.Token(hold), req))
                        continue
                    step = self.script.pop(0)
                    if step == "close":
                        break
                    if step == "sleep":
                        time.sleep(2.5)
                        continue
                    frame, with_fd = {
                        "ok": (P.encode(P.Exported(HANDLE), req), False),
                        "ok+fd": (P.encode(P.Exported(HANDLE), req), True),
                        "error": (P.encode(P.Error(207001, "full"), req), False),
                        "error+fd": (P.encode(P.Error(207001, "full"), req), True),
                        "refuse": (P.encode(P.Error(PARAM, "not served"), 0), False),
                        "refuse+fd": (P.encode(P.Error(PARAM, "not served"), 0), True),
                        "wrong type": (P.encode(P.Ok(), req), False),
                        "wrong type+fd": (P.encode(P.Ok(), req), True),
                        "wrong request": (P.encode(P.Exported(HANDLE), req + 1), False),
                        "short": (P.encode(P.Exported(HANDLE), req)[:-1], False),
                        "too long": (bytes(70000), False),
                    }[step]
                    self._send(conn, frame, with_fd)


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Any]:
    made: list[tuple[ScriptedBroker, BrokerClient]] = []

    def make(*script: str) -> tuple[ScriptedBroker, BrokerClient]:
        fake = ScriptedBroker(tmp_path / f"s{len(made)}", list(script))
        client = BrokerClient(replace(Config.from_env(), socket_path=fake.path), autostart=False)
        made.append((fake, client))
        return fake, client

    yield make
    for fake, client in made:
        client.close()
        fake.close()


PROP = prop_of(0, 0, 1, 1, 0)


def _export(client: BrokerClient, token: int = 0, pids: list[int] | None = None) -> bytes:
    fd = os.memfd_create("export-paths")
    try:
        return client.export(token, fd, PROP, 2 * MiB, 0, 1, pids or [], False)
    finally:
        os.close(fd)


def test_the_written_out_export_sends_the_frame_a_p_export_encodes(scripted: Any) -> None:
    fake, client = scripted("ok")
    assert _export(client, pids=[7, 8]) == HANDLE
    [(kind, req, msg, nfds)] = fake.seen
    assert (kind, nfds) == ("Export", 1) and req != 0
    assert msg == P.Export(0, 2 * MiB, 0, 1, client.config.server_id, 0, 0, 0, 1, 1, 0, (7, 8))


@pytest.mark.parametrize("step", ["ok+fd", "error+fd", "refuse+fd", "wrong type+fd"])
def test_fds_that_come_with_a_reply_are_closed(scripted: Any, step: str) -> None:
    _, client = scripted(step)
    before = null_fds()
    with pytest.raises(IpcError) as info:
        _export(client)
    assert info.value.code == IPC and "file descriptor" in str(info.value)
    assert null_fds() == before and client._sock is None


@pytest.mark.parametrize(("step", "words"), [("wrong type", "OK in reply to EXPORT"),
                                             ("wrong request", "expected"),
                                             ("short", "its header says"),
                                             ("too long", "reply too large")])
def test_replies_that_do_not_follow_the_protocol(scripted: Any, step: str, words: str) -> None:
    fake, client = scripted(step)
    with pytest.raises(IpcError) as info:
        _export(client)
    assert info.value.code == IPC and words in str(info.value)
    assert client._sock is None and len(fake.seen) == 1  # not retried


def test_a_refusal_of_the_connection_raises_its_code_and_drops_it(scripted: Any) -> None:
    fake, client = scripted("refuse")
    with pytest.raises(AclError) as info:
        _export(client)
    assert info.value.code == PARAM and "not served" in str(info.value)
    assert client._sock is None and len(fake.seen) == 1


def test_an_error_reply_keeps_the_connection(scripted: Any) -> None:
    _, client = scripted("error", "ok")
    with pytest.raises(AclError) as info:
        _export(client)
    assert info.value.code == 207001
    sock = client._sock
    assert sock is not None
    assert _export(client) == HANDLE and client._sock is sock


def test_a_broker_that_does_not_answer_is_not_retried(scripted: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "REPLY_TIMEOUT", 0.5)
    fake, client = scripted("sleep", "ok")
    with pytest.raises(IpcError) as info:
        _export(client)
    assert "no reply" in str(info.value) and len(fake.seen) == 1 and client._sock is None


def test_a_broker_that_went_away_is_retried_with_the_hold_the_new_one_gave(scripted: Any) -> None:
    fake, client = scripted("close", "close", "ok")
    token = client.charge(0, 2 * MiB)
    assert _export(client, token) == HANDLE
    exports = [(req, msg) for kind, req, msg, _ in fake.seen if kind == "Export"]
    assert [msg.hold for _, msg in exports] == [100, 200, 300]  # each connection's own hold, read per attempt
    assert len({req for req, _ in exports}) == 3 and all(exports[i][0] for i in range(3))
    assert client._holds[token] == 300


def test_a_broker_lost_on_every_try_is_an_ipc_error(scripted: Any) -> None:
    fake, client = scripted(*["close"] * RETRIES)
    with pytest.raises(IpcError) as info:
        _export(client)
    assert "lost the broker" in str(info.value)
    assert [kind for kind, *_ in fake.seen] == ["Export"] * RETRIES


def test_values_that_do_not_fit_are_refused_before_anything_is_sent(scripted: Any) -> None:
    fake, client = scripted("ok")
    with pytest.raises(P.ProtocolError) as fields_error:
        _export(client, pids=[1 << 32])
    with pytest.raises(P.ProtocolError) as encode_error:
        P.encode(P.Export(0, 2 * MiB, 0, 1, 0, 0, 0, 0, 1, 1, 0, (1 << 32,)), 1)
    assert str(fields_error.value) == str(encode_error.value)
    assert fake.seen == []


# ---------------------------------------------------------------- Device.allocate against the real broker


def _charged() -> tuple[dict[str, int], int]:
    listing = runtime().node.listing()
    return listing["used"], listing["export_count"]


@pytest.mark.parametrize(("kwargs", "code", "words"), [
    ({"size": 0}, ACL_PARAM, "size is 0"),
    ({"size": (1 << 64) - 1}, PARAM, "does not fit a size_t"),
    ({"size": 1, "attr": "huge1g", "location": "host"}, NOT_SUPPORTED, "1 GiB pages"),
    ({"size": 1, "attr": 2}, ACL_PARAM, "host (DDR) memory"),
    ({"size": 1, "attr": 8}, ACL_PARAM, "not a physical memory attribute"),
    ({"size": 1, "numa_node": 0}, PARAM, "numa_node places host memory"),
    ({"size": 1, "location": "host", "numa_node": 1 << 20}, PARAM, "does not exist"),
    ({"size": 1, "location": "host", "numa_node": True}, PARAM, "must be an int"),
    ({"size": 1, "attr": True}, PARAM, "must be an int"),
])
def test_bad_allocations_are_refused_with_their_codes_and_charge_nothing(kwargs: dict[str, Any], code: int,
                                                                         words: str) -> None:
    before = _charged()
    size = kwargs.pop("size")
    with pytest.raises(AclError) as info:
        vmmshare.Device(0).allocate(size, **kwargs)
    assert info.value.code == code and words in str(info.value)
    assert _charged() == before


def test_allocated_props_are_shared_immutable_values() -> None:
    with vmmshare.Device(0).allocate(1) as a, vmmshare.Device(0).allocate(3 * MiB, location="host") as b:
        assert a.size == 2 * MiB and b.size == 4 * MiB
        prop = a._prop
        assert prop == vmmshare.Device(0)._prop("normal", "device")
        with pytest.raises(dataclasses.FrozenInstanceError):
            prop.mem_attr = 2  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            prop.location.id = 3  # type: ignore[misc]
        assert b._prop.location.type == 0 and a._prop.location.type == 1
        handle = a.export()
        assert _travels_intact(handle)


def _travels_intact(handle: vmmshare.ShareableHandle) -> bool:
    import copy
    import pickle

    back = pickle.loads(pickle.dumps(handle))
    return (back == handle and hash(back) == hash(handle) and str(back) == str(handle) and int(back) == int(handle)
            and copy.deepcopy(handle) == handle and vars(back) == vars(handle))
