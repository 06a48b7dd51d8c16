"""The broker's life and its clients' deaths (SPEC §5, §4 rule 14): SIGKILL of an exporter, of an importer and of
the broker itself; auto-start by many processes at once and the idle exit; socket permissions; a second broker
on a live socket; node-wide device capacity; stopping on SIGTERM / SIGINT.

Everything runs in real processes (tests/procs.py). Ordering argument used throughout: a request from a process
that connected to the broker after some client died is served only after the broker has seen that death, since
the death was pending when the broker accepted the new connection.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from procs import PROP, Actor, BrokerProc, MiB2, clean_env, fails, ok
from vmmshare.wire import local as P

MiB = 1 << 20
MiB4 = 4 * MiB
DEFAULT = 1
NO_PID_CHECK = 1
PARAM = 107000
BAD_HANDLE = 107017
NO_MEMORY = 207001
HANG_GUARD = 30.0  # seconds; a guard against hangs only, never part of an assertion


def prop_on(device: int) -> dict[str, Any]:
    return {**PROP, "location": {"id": device, "type": 1}}


class Procs:
    """Brokers and actors started by one test, all stopped at its end (SIGKILL: no test depends on SIGTERM)."""

    def __init__(self) -> None:
        self.brokers: list[BrokerProc] = []
        self.actors: list[Actor] = []
        self.surface = "python"  # the actors' surface: vmmshare.acl, or "c", the C library through `cacl`

    def broker(self, folder: Path, *extra: str, **env: str) -> BrokerProc:
        b = BrokerProc(folder, *extra, env=clean_env(**env))
        self.brokers.append(b)
        return b

    def actor(self, env: dict[str, str]) -> Actor:
        a = Actor({**env, "VMMSHARE_ACTOR_SURFACE": self.surface})
        self.actors.append(a)
        return a

    def close(self) -> None:
        for a in self.actors:
            a.kill()
        for b in self.brokers:
            b.kill()


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def malloc_mapped(actor: Actor, size: int, fill: int, device: int = 0) -> tuple[int, int]:
    """(ptr, handle) of a fresh allocation mapped read-write, filled with `fill` and a label."""
    h = ok(actor, "rt.malloc_physical", size, prop_on(device), 0)
    p = ok(actor, "rt.reserve_mem_address", size, 0, 0, 0)
    ok(actor, "rt.map_mem", p, size, 0, h, 0)
    actor.call("!write", p, fill, size)
    actor.call("!write_bytes", p + size - 16, f"pid {actor.pid}".encode().ljust(16, b"."))
    return p, h


def import_mapped(actor: Actor, shareable: int, size: int) -> tuple[int, int]:
    h = ok(actor, "rt.mem_import_from_shareable_handle_v2", shareable, DEFAULT, 0)
    p = ok(actor, "rt.reserve_mem_address", size, 0, 0, 0)
    ok(actor, "rt.map_mem", p, size, 0, h, 0)
    return p, h


def unmap_free(actor: Actor, ptr: int, handle: int) -> None:
    ok(actor, "rt.unmap_mem", ptr)
    ok(actor, "rt.free_physical", handle)
    ok(actor, "rt.release_mem_address", ptr)


def mem_info(actor: Actor, device: int = 0) -> tuple[int, int]:
    ok(actor, "rt.set_device", device)
    try:
        return ok(actor, "rt.get_mem_info", 0)  # type: ignore[no-any-return]
    finally:
        ok(actor, "rt.reset_device", device)


def ls_json(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "vmmshare.cli", "ls", "--json"], env=env, capture_output=True,
                         text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, f"vmmshare ls --json failed ({out.returncode}): {out.stderr[-2000:]}"
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def bare_tgid_round_trip(path: Path) -> int:
    """The pid the broker at `path` reports for this process, over a fresh connection."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.settimeout(HANG_GUARD)
    try:
        s.connect(str(path))
        s.send(P.encode(P.BareTgid(), 5))
        frame = P.decode(s.recv(P.MAX_FRAME + 1))
    finally:
        s.close()
    assert isinstance(frame.message, P.Pid) and frame.req == 5
    return frame.message.pid


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in (b"Z", b"X")


def wait_exit(pid: int, limit: float) -> None:
    """Wait (at most `limit` seconds, a hang guard) for a process that is not our child to exit."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds here: poll, bounded
        deadline = time.monotonic() + limit
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    try:
        select.select([pidfd], [], [], limit)  # a pidfd turns readable when its process exits
    finally:
        os.close(pidfd)


def brokers_serving(path: Path) -> list[int]:
    """Live processes running a broker for the socket `path`, found by their command lines."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"vmmshare.broker" in args and str(path).encode() in args and not gone(int(name)):
            found.append(int(name))
    return found


# ---------------------------------------------------------------- (a) the exporter dies


@pytest.mark.parametrize("surface", ["python", "c"])
def test_sigkill_of_the_exporter(procs: Procs, tmp_path: Path, surface: str) -> None:
    procs.surface = surface
    broker = procs.broker(tmp_path, VMMSHARE_DEVICE_MEMORY="64M")
    exporter, importer = procs.actor(broker.env), procs.actor(broker.env)
    p, h = malloc_mapped(exporter, MiB4, 0xA5)
    shareable = ok(exporter, "rt.mem_export_to_shareable_handle_v2", h, NO_PID_CHECK, DEFAULT)
    pi, hi = import_mapped(importer, shareable, MiB4)
    digest = exporter.call("!sha256", p, MiB4)
    assert importer.call("!sha256", pi, MiB4) == digest

    exporter.kill()

    assert importer.call("!sha256", pi, MiB4) == digest, "the importer's memory changed when the exporter died"
    importer.call("!write_bytes", pi, b"importer still writes")
    assert importer.call("!read", pi, 21) == b"importer still writes"
    late = procs.actor(broker.env)  # connected after the death, so the broker has seen it
    fails(late, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", shareable, DEFAULT, 0)
    assert ls_json(broker.env)["exports"] == [], "the dead exporter's handle is still listed"
    assert mem_info(late) == (64 * MiB - MiB4, 64 * MiB), "the importer's hold must keep the memory charged"

    unmap_free(importer, pi, hi)
    assert mem_info(late) == (64 * MiB, 64 * MiB), "capacity not released after the last holder freed"
    assert ls_json(broker.env)["used"] == {}


# ---------------------------------------------------------------- (b) an importer dies


@pytest.mark.parametrize("surface", ["python", "c"])
def test_sigkill_of_an_importer(procs: Procs, tmp_path: Path, surface: str) -> None:
    procs.surface = surface
    broker = procs.broker(tmp_path, VMMSHARE_DEVICE_MEMORY="64M")
    exporter, importer = procs.actor(broker.env), procs.actor(broker.env)
    p, h = malloc_mapped(exporter, MiB4, 0x5A)
    shareable = ok(exporter, "rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
    ok(exporter, "rt.mem_set_pid_to_shareable_handle_v2", shareable, DEFAULT, [importer.pid])
    pi, _ = import_mapped(importer, shareable, MiB4)
    assert importer.call("!sha256", pi, MiB4) == exporter.call("!sha256", p, MiB4)
    (row,) = ls_json(broker.env)["exports"]
    assert row["importers"] == [importer.pid] and row["owner_pid"] == exporter.pid

    importer.kill()

    listing = ls_json(broker.env)
    (row,) = listing["exports"]
    assert row["importers"] == [], "the broker still counts a dead importer"
    assert listing["used"] == {"0": MiB4}
    # the export itself is untouched: another trustlisted process imports it
    other = procs.actor(broker.env)
    ok(exporter, "rt.mem_set_pid_to_shareable_handle_v2", shareable, DEFAULT, [other.pid])
    po, ho = import_mapped(other, shareable, MiB4)
    assert other.call("!sha256", po, MiB4) == exporter.call("!sha256", p, MiB4)
    unmap_free(other, po, ho)
    assert mem_info(exporter) == (64 * MiB - MiB4, 64 * MiB)

    unmap_free(exporter, p, h)
    assert mem_info(exporter) == (64 * MiB, 64 * MiB), "the dead importer's hold was not released"
    listing = ls_json(broker.env)
    assert listing["exports"] == [] and listing["used"] == {}


# ---------------------------------------------------------------- (c) the broker dies


@pytest.mark.parametrize("surface", ["python", "c"])
def test_sigkill_of_the_broker_keeps_mappings_and_clients_reconnect(procs: Procs, tmp_path: Path,
                                                                    surface: str) -> None:
    procs.surface = surface
    broker = procs.broker(tmp_path, VMMSHARE_DEVICE_MEMORY="64M")
    exporter, importer = procs.actor(broker.env), procs.actor(broker.env)
    p, h = malloc_mapped(exporter, MiB4, 0x11)
    shareable = ok(exporter, "rt.mem_export_to_shareable_handle_v2", h, 0, DEFAULT)
    ok(exporter, "rt.mem_set_pid_to_shareable_handle_v2", shareable, DEFAULT, [importer.pid])
    pi, hi = import_mapped(importer, shareable, MiB4)
    old_pid = broker.pid

    broker.kill()

    # with no broker at all, both mappings are the same live memory (no broker call is made here: one would
    # auto-start a broker of its own)
    exporter.call("!write", p, 0x22, MiB4)
    assert importer.call("!sha256", pi, MiB4) == exporter.call("!sha256", p, MiB4)
    importer.call("!write_bytes", pi, b"written while the broker was down")
    assert exporter.call("!read", p, 33) == b"written while the broker was down"
    digest = exporter.call("!sha256", p, MiB4)

    broker.start()
    assert broker.pid != old_pid

    # the same processes go on: their clients reconnect by themselves
    p2, h2 = malloc_mapped(exporter, MiB2, 0x33)
    shareable2 = ok(exporter, "rt.mem_export_to_shareable_handle_v2", h2, 0, DEFAULT)
    ok(exporter, "rt.mem_set_pid_to_shareable_handle_v2", shareable2, DEFAULT, [importer.pid])
    pi2, hi2 = import_mapped(importer, shareable2, MiB2)
    assert importer.call("!sha256", pi2, MiB2) == exporter.call("!sha256", p2, MiB2)
    assert importer.call("!sha256", pi, MiB4) == digest, "the old mapping changed across the broker restart"

    listing = ls_json(broker.env)
    assert listing["broker_pid"] == broker.pid
    assert [r["handle"] for r in listing["exports"]] == [f"{shareable2:#018x}"]
    # the exporter's allocation that outlived the old broker is charged again: 4 MiB + 2 MiB
    assert listing["used"] == {"0": MiB4 + MiB2}
    observer = procs.actor(broker.env)
    assert mem_info(observer) == (64 * MiB - MiB4 - MiB2, 64 * MiB)
    fails(observer, BAD_HANDLE, "rt.mem_import_from_shareable_handle_v2", shareable, DEFAULT, 0)

    unmap_free(importer, pi, hi)
    unmap_free(exporter, p, h)
    assert mem_info(observer) == (64 * MiB - MiB2, 64 * MiB), "the re-charged allocation was not released"
    unmap_free(importer, pi2, hi2)
    unmap_free(exporter, p2, h2)
    assert mem_info(observer) == (64 * MiB, 64 * MiB)


# ---------------------------------------------------------------- (d) auto-start and idle exit


def _call_all(actors: list[Actor], name: str, *args: Any) -> list[Any]:
    """Send the same call to every actor before reading any reply, so they all run it at once."""
    line = json.dumps({"call": name, "args": list(args)}) + "\n"
    for a in actors:
        assert a.proc.stdin is not None
        a.proc.stdin.write(line)
        a.proc.stdin.flush()
    out = []
    for a in actors:
        assert a.proc.stdout is not None
        reply = json.loads(a.proc.stdout.readline())
        assert "ok" in reply, f"actor {a.pid}: {reply}"
        out.append(reply["ok"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("surface", ["python", "c"])
def test_auto_start_one_broker_for_many_clients_then_idle_exit(procs: Procs, tmp_path: Path, surface: str) -> None:
    procs.surface = surface
    folder = tmp_path / "auto"
    sock = folder / "broker.sock"
    env = clean_env(VMMSHARE_SOCKET=str(sock), VMMSHARE_BROKER_IDLE="1", VMMSHARE_DEVICE_MEMORY="64M")
    actors = [procs.actor(env) for _ in range(8)]
    assert not sock.exists() and brokers_serving(sock) == [], "a broker was started before anyone needed one"

    handles = [h for h, ret in (tuple(r) for r in _call_all(actors, "rt.malloc_physical", MiB2, PROP, 0))
               if ret == 0]
    assert len(handles) == 8, "not every concurrent first call succeeded"

    serving = brokers_serving(sock)
    assert len(serving) == 1, f"{len(serving)} brokers were started for one socket: {serving}"
    (broker_pid,) = serving
    listing = ls_json(env)
    assert listing["broker_pid"] == broker_pid
    assert listing["used"] == {"0": 8 * MiB2}, "the allocations were not all charged to one broker"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600

    # one export seen by all the others: they all talk to that same broker
    first = actors[0]
    p = ok(first, "rt.reserve_mem_address", MiB2, 0, 0, 0)
    ok(first, "rt.map_mem", p, MiB2, 0, handles[0], 0)
    first.call("!write_bytes", p, b"one broker for all")
    shareable = ok(first, "rt.mem_export_to_shareable_handle_v2", handles[0], NO_PID_CHECK, DEFAULT)
    for a in actors[1:]:
        pa, _ = import_mapped(a, shareable, MiB2)
        assert a.call("!read", pa, 18) == b"one broker for all"
    (row,) = ls_json(env)["exports"]
    assert sorted(row["importers"]) == sorted(a.pid for a in actors[1:])
    assert brokers_serving(sock) == [broker_pid]

    for a in actors:
        a.close()
    wait_exit(broker_pid, 20)  # VMMSHARE_BROKER_IDLE=1: it should leave about a second after the last client
    assert gone(broker_pid), "the auto-started broker did not exit once idle with nothing held"
    assert not sock.exists(), "the idle broker left its socket behind"


@pytest.mark.parametrize("gone_what", ["folder", "socket"])
def test_an_idle_broker_whose_socket_is_gone_exits(procs: Procs, tmp_path: Path, gone_what: str) -> None:
    """An auto-started broker whose socket (or its whole folder: a test session's temporary folder, cleaned up) was
    removed cannot be reached by anyone new: once idle it leaves, rather than waiting for a start lock it cannot
    make there."""
    folder = tmp_path / "auto"
    sock = folder / "broker.sock"
    env = clean_env(VMMSHARE_SOCKET=str(sock), VMMSHARE_BROKER_IDLE="0.5")
    actor = procs.actor(env)
    assert ok(actor, "rt.device_get_bare_tgid") == actor.pid  # starts the broker
    (broker_pid,) = brokers_serving(sock)
    if gone_what == "folder":
        shutil.rmtree(folder)
    else:
        sock.unlink()
    actor.close()
    wait_exit(broker_pid, 20)
    assert gone(broker_pid), f"the idle broker stayed after its {gone_what} was removed"


# ---------------------------------------------------------------- (e) permissions


@pytest.mark.parametrize(("extra", "sock_mode"), [((), 0o600), (("--multi-user",), 0o666)],
                         ids=["default", "multi_user"])
def test_socket_permissions(procs: Procs, tmp_path: Path, extra: tuple[str, ...], sock_mode: int) -> None:
    folder = tmp_path / "run" / "vmmshare"
    folder.parent.mkdir()  # the broker creates only the socket's own folder
    broker = procs.broker(folder, *extra)
    st = broker.socket.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == sock_mode
    folder_mode = stat.S_IMODE(folder.stat().st_mode)
    if extra:
        assert folder_mode & 0o022 == 0, "a multi-user socket folder must not be writable by others"
        assert folder_mode & 0o011 == 0o011, "other users must be able to reach the multi-user socket"
    else:
        assert folder_mode == 0o700
    assert bare_tgid_round_trip(broker.socket) == os.getpid()


# ---------------------------------------------------------------- (f) a second broker on a live socket


@pytest.mark.parametrize("how", ["cli", "module_auto"])
def test_second_broker_refuses_a_live_socket(procs: Procs, tmp_path: Path, how: str) -> None:
    broker = procs.broker(tmp_path)
    before = sorted(os.listdir(tmp_path))
    inode = broker.socket.stat().st_ino
    cmd = {
        "cli": [sys.executable, "-m", "vmmshare.cli", "broker", "--socket", str(broker.socket)],
        "module_auto": [sys.executable, "-m", "vmmshare.broker", "--socket", str(broker.socket), "--auto"],
    }[how]
    second = subprocess.run(cmd, env=broker.env, capture_output=True, text=True, timeout=HANG_GUARD)
    assert second.returncode != 0, "a second broker started on a socket that a live broker serves"
    assert "already" in second.stderr or str(broker.socket) in second.stderr, second.stderr
    assert broker.alive()
    assert broker.socket.stat().st_ino == inode, "the second broker replaced the live socket"
    assert sorted(os.listdir(tmp_path)) == before, "the second broker left files behind"
    assert bare_tgid_round_trip(broker.socket) == os.getpid()
    assert ls_json(broker.env)["broker_pid"] == broker.pid


# ---------------------------------------------------------------- (g) capacity for the whole node


def test_capacity_is_node_wide(procs: Procs, tmp_path: Path) -> None:
    broker = procs.broker(tmp_path, VMMSHARE_DEVICE_MEMORY="8M")
    a, b = procs.actor(broker.env), procs.actor(broker.env)
    ha = ok(a, "rt.malloc_physical", MiB4, PROP, 0)
    hb = ok(b, "rt.malloc_physical", MiB4, PROP, 0)
    fds_a, fds_b = a.call("!fd_count"), b.call("!fd_count")
    fails(a, NO_MEMORY, "rt.malloc_physical", MiB2, PROP, 0)
    fails(b, NO_MEMORY, "rt.malloc_physical", MiB2, PROP, 0)
    assert (a.call("!fd_count"), b.call("!fd_count")) == (fds_a, fds_b), "a refused allocation leaked an fd"
    c = procs.actor(broker.env)
    assert mem_info(c) == (0, 8 * MiB)
    assert ls_json(broker.env)["used"] == {"0": 8 * MiB}

    # capacity is per device: device 1 is still empty
    h1 = ok(c, "rt.malloc_physical", 8 * MiB, prop_on(1), 0)
    assert mem_info(c, 1) == (0, 8 * MiB)
    ok(c, "rt.free_physical", h1)

    ok(a, "rt.free_physical", ha)
    assert mem_info(c) == (MiB4, 8 * MiB)
    hb2 = ok(b, "rt.malloc_physical", MiB2, PROP, 0)
    assert mem_info(c) == (MiB2, 8 * MiB)
    ok(b, "rt.free_physical", hb)
    ok(b, "rt.free_physical", hb2)
    assert mem_info(c) == (8 * MiB, 8 * MiB)


# ---------------------------------------------------------------- stopping


def _blocked_waiting(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        return True  # cannot tell: send the signal anyway
    return "poll" in wchan or "wait" in wchan  # "0": running (or hidden; then the deadline lets it go)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_an_idle_broker(procs: Procs, tmp_path: Path, sig: int) -> None:
    """`vmmshare broker` in the foreground stops on SIGTERM (service managers) and SIGINT (Ctrl-C), also while it
    sits idle waiting for clients, and removes its socket."""
    broker = procs.broker(tmp_path)
    assert bare_tgid_round_trip(broker.socket) == os.getpid()
    deadline = time.monotonic() + 5  # no event says "the broker is back in its wait": look at where it sleeps
    while not _blocked_waiting(broker.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broker.proc is not None
    broker.proc.send_signal(sig)
    try:
        code = broker.proc.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the broker ignored {signal.Signals(sig).name} while idle")
    assert code == 0
    assert not broker.socket.exists(), "a broker that stopped cleanly left its socket behind"



# ---------------------------------------------------------------- every wait of a client is bounded

BOUNDED = """
import os, signal, socket, sys
import vmmshare.client.autostart as au
import vmmshare.client.connection as cl
from vmmshare.config import Config
from vmmshare.errors import AclError

cl.REPLY_TIMEOUT = au.CONNECT_TIMEOUT = au.START_TIMEOUT = 0.3
connects = []
_try_connect = au._try_connect
au._try_connect = lambda path: connects.append(path) or _try_connect(path)
case, broker = sys.argv[1], int(sys.argv[2])
client = cl.BrokerClient(Config.from_env(), autostart=case == "start_lock")
queued = []
try:
    if case != "start_lock":
        client.bare_tgid()  # connected and answered; then the broker stops
        os.kill(broker, signal.SIGSTOP)
    if case == "full_queue":  # and its listen queue fills up
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
            try:
                s.connect(os.environ["VMMSHARE_SOCKET"])
            except BlockingIOError:  # the queue is full
                s.close()
                break
            queued.append(s)
        client._reset()  # the next request connects anew
    client.bare_tgid()
    print("answered")
except AclError as exc:
    print(exc.code, len(connects), exc.message)
finally:
    if case != "start_lock":
        os.kill(broker, signal.SIGCONT)
"""


@pytest.mark.parametrize("case", ["no_reply", "full_queue", "start_lock"])
def test_a_stuck_broker_costs_a_client_one_bounded_wait(procs: Procs, tmp_path: Path, case: str) -> None:
    """A broker that stopped answering, or stopped accepting, or a start lock held forever by a stuck starter:
    the client's call fails with 507022 after one bounded wait (no reconnect storm, no hang)."""
    if case == "start_lock":
        folder = tmp_path / "nobroker"
        folder.mkdir(mode=0o700)
        env = clean_env(VMMSHARE_SOCKET=str(folder / "broker.sock"))
        lock = os.open(folder / "broker.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)  # held by this test for the whole call
        pid = 0
    else:
        broker = procs.broker(tmp_path)
        env, pid, lock = broker.env, broker.pid, -1
    try:
        out = subprocess.run([sys.executable, "-c", BOUNDED, case, str(pid)], env=env, capture_output=True,
                             text=True, timeout=HANG_GUARD)
    finally:
        if lock >= 0:
            os.close(lock)
    code, connects, message = out.stdout.split(maxsplit=2)
    assert code == "507022", out.stdout + out.stderr
    expected = {"no_reply": ("1", "no reply"), "full_queue": ("2", "does not take connections"),
                "start_lock": ("1", "stayed locked")}[case]
    assert connects == expected[0], out.stdout  # one connection attempt for the failing call: no retries
    assert expected[1] in message, message
