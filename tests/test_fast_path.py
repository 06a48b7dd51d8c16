"""The packets' two paths, the compiled fast path (sockets/_fastpackets.c) and the pure-Python fallback: each test
runs on both, over real SEQPACKET sockets, with fds, credentials, truncation and bad input; a real broker and real
client processes share memory with every mix of the two; VMMSHARE_PURE_PYTHON picks the fallback."""

from __future__ import annotations

import fcntl
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import rawsock
from conftest import require
from procs import PROP, Actor, BrokerProc, MiB2, share_and_map
from vmmshare.sockets import packets
from vmmshare.wire import local as P
from vmmshare.wire.local import MAX_FDS, MAX_FRAME

NO_PERMISSION = 207006
PATHS = ["pure", "compiled"]


def _path(name: str) -> SimpleNamespace:
    if name == "compiled" and not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here (no compiler at install time)")
    pick = {"pure": "pure_", "compiled": "fast_"}[name]
    return SimpleNamespace(name=name, **{f: getattr(packets, pick + f) for f in
                                         ("recv_packet", "recv_request", "send_packet", "call", "wait")})


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> SimpleNamespace:
    """recv_packet, recv_request, send_packet and call of one path."""
    return _path(request.param)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected SEQPACKET pair: (the sender's end, the receiver's end with SO_PASSCRED)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    packets.pass_credentials(b)
    yield a, b
    a.close()
    b.close()


def open_fds() -> set[int]:
    """This process's open fds, once the garbage of earlier tests is collected (its finalizers close fds of their
    own, which must not show up as this test's)."""
    gc.collect()
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def closing(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# ---------------------------------------------------------------- one packet, both paths


def test_the_extension_is_built_where_a_compiler_is() -> None:
    """An install on a machine with a C compiler builds the fast path (and this process uses it, unless told not)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) here: the pure-Python path is the one installed")
    assert packets.FAST_AVAILABLE, "a compiler is here but vmmshare.sockets._fastpackets was not built"


@pytest.mark.parametrize("nfds", [0, 1])
def test_a_packet_and_its_fds_arrive_close_on_exec(path: SimpleNamespace, pair: Any, nfds: int) -> None:
    a, b = pair
    memfd = os.memfd_create("fast-path-test")
    try:
        path.send_packet(a, b"hello, broker", (memfd,) * nfds)
        data, fds, truncated, sender = path.recv_request(b)
        try:
            assert (data, len(fds), truncated, sender) == (b"hello, broker", nfds, False, os.getpid())
            for fd in fds:
                assert same_file(fd, memfd) and fd != memfd
                assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        finally:
            closing(fds)
    finally:
        os.close(memfd)


def test_the_sender_is_the_process_that_sent_not_the_one_that_connected(path: SimpleNamespace, pair: Any) -> None:
    """A forked child writing on its parent's connection is named by the kernel's credentials: its own pid."""
    a, b = pair
    child = os.fork()
    if child == 0:
        try:
            path.send_packet(a, b"from the child")
        finally:
            os._exit(0)
    data, fds, truncated, sender = path.recv_request(b)
    assert os.waitpid(child, 0)[1] == 0
    assert (data, fds, truncated, sender) == (b"from the child", [], False, child)


def test_no_credentials_without_so_passcred(path: SimpleNamespace) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        path.send_packet(a, b"x")
        assert path.recv_request(b) == (b"x", [], False, -1)
        path.send_packet(a, b"y")
        assert path.recv_packet(b) == (b"y", [], False)


@pytest.mark.parametrize(("size", "cut"), [(1, False), (MAX_FRAME, False), (MAX_FRAME + 1, True),
                                           (MAX_FRAME + 1000, True)])
def test_a_packet_longer_than_max_frame_comes_back_truncated(path: SimpleNamespace, pair: Any, size: int,
                                                             cut: bool) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * size)
    path.send_packet(a, b"z" * size)
    data, fds, truncated, _ = path.recv_request(b)
    assert (truncated, fds) == (cut, [])
    assert data == b"z" * min(size, MAX_FRAME + 1)


@pytest.mark.parametrize("nfds", [MAX_FDS + 1, MAX_FDS + 4, MAX_FDS + 5, 16])
def test_more_fds_than_asked_for_are_all_handed_back_or_dropped_never_kept(path: SimpleNamespace, pair: Any,
                                                                          nfds: int) -> None:
    """Room for a few more than MAX_FDS, so that extra ones show: those that fit come back (the caller closes
    them), those that do not are closed by the kernel (the packet then comes back truncated)."""
    a, b = pair
    before = open_fds()
    r, w = os.pipe()
    try:
        path.send_packet(a, b"fds", (w,) * nfds)
        data, fds, truncated, sender = path.recv_request(b)
        assert data == b"fds" and sender == os.getpid()
        assert truncated == (len(fds) < nfds) and (truncated or nfds <= MAX_FDS + 6)  # room: MAX_FDS + 4, padded
        assert all(same_file(fd, w) for fd in fds)
        closing(fds)
    finally:
        os.close(w)
    try:  # every copy of the write end is gone: the read end sees EOF, at once
        assert os.read(r, 1) == b""
    finally:
        os.close(r)
    assert open_fds() == before


def test_bad_fds_are_refused_before_anything_is_sent(path: SimpleNamespace, pair: Any) -> None:
    a, b = pair
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError) as bad:
        path.send_packet(a, b"closed fd", (w,))
    assert bad.value.errno == 9  # EBADF
    with pytest.raises(OverflowError):
        path.send_packet(a, b"fd out of range", (1 << 40,))
    with pytest.raises(TypeError):
        path.send_packet(a, b"not an fd", ("3",))  # type: ignore[arg-type]
    with pytest.raises(OSError):
        path.send_packet(a, b"too many fds", (0,) * 300)
    path.send_packet(a, b"after")
    assert path.recv_request(b) == (b"after", [], False, os.getpid()), "a refused send sent something"


def test_nothing_to_read_and_a_closed_peer(path: SimpleNamespace, pair: Any) -> None:
    a, b = pair
    with pytest.raises(BlockingIOError):
        path.recv_request(b, packets.DONTWAIT)
    with pytest.raises(BlockingIOError):
        path.recv_packet(b, packets.DONTWAIT)
    a.close()
    assert path.recv_packet(b) == (b"", [], False)  # end of the connection
    with pytest.raises(BrokenPipeError):  # not SIGPIPE: this process lives on to see the error
        path.send_packet(b, b"to nobody")


def test_a_closed_socket_is_an_error_not_a_crash(path: SimpleNamespace) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.close()
    b.close()
    with pytest.raises(OSError):
        path.send_packet(a, b"x")
    with pytest.raises(OSError):
        path.recv_packet(a)


def test_a_signal_during_a_blocking_receive(path: SimpleNamespace, pair: Any) -> None:
    """A handler that returns: the receive goes on (PEP 475) and gets the packet the handler sent. A handler that
    raises: its exception comes out of the receive, and nothing leaks."""
    a, b = pair

    def send_from_handler(signum: int, frame: object) -> None:
        path.send_packet(a, b"sent by the handler")

    previous = signal.signal(signal.SIGALRM, send_from_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert path.recv_request(b) == (b"sent by the handler", [], False, os.getpid())

        class Stop(Exception):
            pass

        def raise_from_handler(signum: int, frame: object) -> None:
            raise Stop

        signal.signal(signal.SIGALRM, raise_from_handler)
        before = open_fds()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Stop):
            path.recv_request(b)
        assert open_fds() == before
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("case", [(b"", 0), (b"a", 1), (b"q" * 4096, 1), (b"r" * (MAX_FRAME + 1), 1),
                                  (b"s" * 100, MAX_FDS + 6)], ids=["empty", "one", "page", "long", "fds"])
def test_both_paths_read_every_packet_alike(pair: Any, case: tuple[bytes, int]) -> None:
    """The same packet, read by each path (sent by the other): the same data, fd count, truncation and sender."""
    if not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here")
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 18)
    data, nfds = case
    seen = []
    r, w = os.pipe()
    try:
        for sender, receiver in ((_path("pure"), _path("compiled")), (_path("compiled"), _path("pure"))):
            sender.send_packet(a, data, (w,) * nfds)
            got, fds, truncated, pid = receiver.recv_request(b)
            closing(fds)
            seen.append((got, len(fds), truncated, pid))
            sender.send_packet(a, data, (w,) * nfds)
            got, fds, truncated = receiver.recv_packet(b)
            closing(fds)
            seen.append((got, len(fds), truncated))
    finally:
        os.close(r)
        os.close(w)
    assert seen[0] == seen[2] and seen[1] == seen[3]


# ---------------------------------------------------------------- a request and its reply in one call, both paths


def _answer(b: socket.socket, reply: bytes, fds: tuple[int, ...] = (), after: threading.Event | None = None) -> Any:
    """A thread that takes one request on `b` and answers it with `reply` (and `fds`), once `after` is set if
    given; join it to get the request."""
    got: list[bytes] = []

    def run() -> None:
        got.append(packets.pure_recv_packet(b)[0])
        if after is not None:
            after.wait(30)
        packets.pure_send_packet(b, reply, fds)

    thread = threading.Thread(target=run)
    thread.start()
    thread.got = got  # type: ignore[attr-defined]
    return thread


@pytest.mark.parametrize("spin", [0.0, 0.001])
def test_a_call_sends_the_request_and_returns_its_reply_with_its_fds(path: SimpleNamespace, pair: Any,
                                                                   spin: float) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        server = _answer(b, b"the reply", (w,))
        data, fds, truncated, _ = path.call(a, b"the request", spin, 30.0)
        server.join()
        assert server.got == [b"the request"]
        assert (data, len(fds), truncated) == (b"the reply", 1, False)
        assert same_file(fds[0], w) and fcntl.fcntl(fds[0], fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        closing(fds)
    finally:
        os.close(r)
        os.close(w)


def test_a_call_says_when_its_poll_ran_out_before_the_reply(path: SimpleNamespace, pair: Any) -> None:
    """A reply that comes after the polling window: the call waits on in the kernel and gets it, and says the poll
    missed (the client polls less after that); with no window, nothing is said to have missed."""
    a, b = pair
    late = threading.Event()
    server = _answer(b, b"late", after=late)
    timer = threading.Timer(0.05, late.set)  # the reply is late on purpose: well past the 50 µs window
    timer.start()
    assert path.call(a, b"q", 0.00005, 30.0) == (b"late", [], False, True)
    server.join()
    server = _answer(b, b"at once")
    assert path.call(a, b"q", 0.0, 30.0) == (b"at once", [], False, False)
    server.join()


def test_a_wait_takes_the_reply_to_a_request_sent_with_fds(path: SimpleNamespace, pair: Any) -> None:
    """`wait` is `call`'s second half, for a request that carries fds (an export) or has work done between (an
    allocation): the reply and its fds, polled for first or not, and a late one said to have been missed."""
    a, b = pair
    r, w = os.pipe()
    try:
        server = _answer(b, b"the reply", (w,))
        path.send_packet(a, b"with an fd", (r,))
        data, fds, truncated, _ = path.wait(a, 0.001, 30.0)
        server.join()
        assert (data, len(fds), truncated) == (b"the reply", 1, False)
        assert same_file(fds[0], w)
        closing(fds)
        late = threading.Event()
        server = _answer(b, b"late", after=late)
        timer = threading.Timer(0.05, late.set)
        timer.start()
        path.send_packet(a, b"q", ())
        assert path.wait(a, 0.00005, 30.0) == (b"late", [], False, True)
        server.join()
        server = _answer(b, b"unpolled")
        path.send_packet(a, b"q", ())
        assert path.wait(a, 0.0, 30.0) == (b"unpolled", [], False, False)
        server.join()
    finally:
        os.close(r)
        os.close(w)


def test_a_wait_without_a_reply_times_out_and_a_bad_window_is_refused(path: SimpleNamespace, pair: Any) -> None:
    a, _ = pair
    before = open_fds()
    with pytest.raises(TimeoutError, match="did not answer within"):
        path.wait(a, 0.0001, 0.05)
    assert open_fds() == before
    if path.name == "compiled":
        for bad in ((a, -1.0, 1.0), (a, 0.0, -1.0), (a, 11.0, 1.0), (a, "0", 1.0), (a, 0.0), (-5, 0.0, 1.0)):
            with pytest.raises((TypeError, ValueError, OSError)):
                path.wait(*bad)


def test_a_compiled_call_reads_the_run_queue_when_its_reply_is_late_and_never_polls_while_every_core_is_busy(
        pair: Any, tmp_path: Path) -> None:
    """The run queue is read at the moment the call would poll: here it is a FIFO, so the call's reading is seen
    (it blocks in its open until a writer comes) and answered with every core busy. The call then waits in the
    kernel without one poll: the reply, sent only after that reading, is not caught by a poll (missed, and the
    client's next calls wait without polling too), though the window was 5 s."""
    if not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here (no compiler at install time)")
    from vmmshare.sockets import _fastpackets, spinning

    a, b = pair
    fifo = tmp_path / "loadavg"
    os.mkfifo(fifo)
    read = threading.Event()

    def busy_reading() -> None:  # the writer's end, once the call opens the reading end
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                time.sleep(0.001)
                continue
            os.write(fd, f"3.00 2.00 1.00 {spinning.CORES + 1}/300 4242\n".encode())
            os.close(fd)
            read.set()
            return

    server = _answer(b, b"after the reading", after=read)
    writer = threading.Thread(target=busy_reading)
    writer.start()
    _fastpackets.watch_load(str(fifo), spinning.CORES)
    try:
        assert packets.fast_call(a, b"q", 5.0, 30.0) == (b"after the reading", [], False, True)
    finally:
        _fastpackets.watch_load(spinning.LOADAVG, spinning.CORES)
        writer.join()
        server.join()
    assert read.is_set()


def test_a_compiled_call_with_a_run_queue_that_cannot_be_read(pair: Any, tmp_path: Path) -> None:
    """No /proc/loadavg where it is looked for, or garbage in it: the call goes on as on a free core (its reply
    comes back) and the reading leaves nothing open."""
    if not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here (no compiler at install time)")
    from vmmshare.sockets import _fastpackets, spinning

    a, b = pair
    garbage = tmp_path / "garbage"
    garbage.write_text("0.1 0.2 0.3 x/y 1\n")
    for where in (tmp_path / "missing", garbage):
        _fastpackets.watch_load(str(where), spinning.CORES)
        try:
            before = open_fds()
            server = _answer(b, b"at once")
            assert packets.fast_call(a, b"q", 5.0, 30.0)[:3] == (b"at once", [], False)
            server.join()
            assert open_fds() == before  # the reading left nothing open
        finally:
            _fastpackets.watch_load(spinning.LOADAVG, spinning.CORES)


@pytest.mark.parametrize("args", [(), ("/proc/loadavg",), (b"/proc/loadavg", 2), ("", 2), ("/proc/loadavg", 0),
                                  ("/proc/\0loadavg", 2), ("/" * 5000, 2), ("/proc/loadavg", "2")])
def test_watch_load_refuses_bad_arguments(args: tuple[Any, ...]) -> None:
    if not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here (no compiler at install time)")
    from vmmshare.sockets import _fastpackets

    with pytest.raises((TypeError, ValueError)):
        _fastpackets.watch_load(*args)


def test_a_call_without_a_reply_times_out_and_leaks_nothing(path: SimpleNamespace, pair: Any) -> None:
    a, b = pair
    before = open_fds()
    with pytest.raises(TimeoutError, match="did not answer within"):
        path.call(a, b"unanswered", 0.0001, 0.05)
    assert packets.pure_recv_packet(b)[0] == b"unanswered"
    assert open_fds() == before


def test_a_call_to_a_peer_that_closes_or_is_gone(path: SimpleNamespace, pair: Any) -> None:
    """The peer closes after reading the request: the end of the connection comes back (no data, no fds); a peer
    gone before the request: the send fails with BrokenPipeError, never SIGPIPE."""
    a, b = pair

    def read_and_close() -> None:
        packets.pure_recv_packet(b)
        b.close()

    thread = threading.Thread(target=read_and_close)
    thread.start()
    assert path.call(a, b"q", 0.0001, 30.0)[:3] == (b"", [], False)
    thread.join()
    with pytest.raises(BrokenPipeError):
        path.call(a, b"to nobody", 0.0, 30.0)


def test_a_call_s_reply_longer_than_max_frame_comes_back_truncated(path: SimpleNamespace, pair: Any) -> None:
    a, b = pair
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 18)
    server = _answer(b, b"z" * (MAX_FRAME + 1))
    data, fds, truncated, _ = path.call(a, b"q", 0.0, 30.0)
    server.join()
    assert (len(data), fds, truncated) == (MAX_FRAME + 1, [], True)


def test_a_signal_during_a_call_s_wait(path: SimpleNamespace, pair: Any) -> None:
    """A handler that returns: the call waits on and gets the reply the handler sent. One that raises: its
    exception comes out of the call, and nothing leaks."""
    a, b = pair

    def answer_from_handler(signum: int, frame: object) -> None:
        packets.pure_send_packet(b, b"from the handler")

    previous = signal.signal(signal.SIGALRM, answer_from_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert path.call(a, b"q", 0.0001, 30.0)[:3] == (b"from the handler", [], False)

        class Stop(Exception):
            pass

        def raise_from_handler(signum: int, frame: object) -> None:
            raise Stop

        signal.signal(signal.SIGALRM, raise_from_handler)
        before = open_fds()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Stop):
            path.call(a, b"q", 0.0001, 30.0)
        assert open_fds() == before
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_call_s_bad_arguments_are_refused_before_anything_is_sent(pair: Any) -> None:
    if not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here")
    a, b = pair
    for args in ((a, b"q", -1.0, 1.0), (a, b"q", 0.0, -1.0), (a, b"q", float("nan"), 1.0), (a, b"q", 0.0, 1e9)):
        with pytest.raises(ValueError, match="out of range"):
            packets.fast_call(*args)
    with pytest.raises(TypeError):
        packets.fast_call(a, b"q", "0", 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        packets.fast_call(a, "not bytes", 0.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        packets.fast_call(a, b"q", 0.0)  # type: ignore[call-arg]
    with pytest.raises(BlockingIOError):
        packets.pure_recv_packet(b, packets.DONTWAIT)  # nothing was sent


def _in_a_child(path: SimpleNamespace, code: str) -> str:
    """Run `code` in a fresh interpreter with `send_packet` and `recv_packet` of `path` bound: a crash there (a
    signal, not an exception) fails the test instead of ending the run. Its stdout, once it exited 0."""
    pick = "fast_" if path.name == "compiled" else "pure_"
    prelude = ("import os, socket, sys, threading\n"
               "from vmmshare.sockets import packets\n"
               f"send_packet, recv_packet = packets.{pick}send_packet, packets.{pick}recv_packet\n")
    done = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stderr}"
    return done.stdout


def test_fds_in_a_list_that_an_item_empties_while_it_is_read(path: SimpleNamespace) -> None:
    """An fd whose __index__ empties the list it is in: the other items are still there to read (or the send is
    refused), never read from freed memory."""
    out = _in_a_child(path, (
        "a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "r, w = os.pipe()\n"
        "fds = []\n"
        "class Emptying:\n"
        "    def __index__(self):\n"
        "        fds.clear()\n"
        "        [[object() for _ in range(8)] for _ in range(2000)]  # reuse what the list held\n"
        "        return w\n"
        "fds.extend([Emptying(), w, w, w])\n"
        "try:\n"
        "    send_packet(a, b'x', fds)\n"
        "except (IndexError, TypeError) as exc:\n"
        "    print('refused', type(exc).__name__)\n"
        "else:\n"
        "    data, got, cut = packets.pure_recv_packet(b)\n"
        "    assert data == b'x' and not cut and all(os.path.sameopenfile(fd, w) for fd in got), got\n"
        "    print('sent', len(got))\n"))
    assert out.split()[0] in ("refused", "sent")


def test_a_receive_on_a_thread_with_the_least_stack(path: SimpleNamespace) -> None:
    """threading.stack_size allows 32 KiB: a full-size packet is received there too (its buffer is not on the
    stack)."""
    out = _in_a_child(path, (
        "threading.stack_size(32 * 1024)\n"
        "a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 18)\n"
        f"send_packet(a, b'm' * {MAX_FRAME + 1})\n"
        "got = []\n"
        "reader = threading.Thread(target=lambda: got.append(recv_packet(b)))\n"
        "reader.start()\n"
        "reader.join()\n"
        "data, fds, cut = got[0]\n"
        "print(len(data), len(fds), cut)\n"))
    assert out.split() == [str(MAX_FRAME + 1), "0", "True"]


def test_the_first_bad_argument_is_the_error_named() -> None:
    """Each argument is checked as it is read: a later one's conversion (which may run Python code) never runs
    with an earlier one's error pending, nor clears it."""
    if not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here")
    from vmmshare.sockets import _fastpackets

    class Five:
        def __index__(self) -> int:
            return int("5")  # Python code, run by the conversion

    with pytest.raises(TypeError):
        _fastpackets.configure("64k", Five())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _fastpackets.floor_serve("3", Five())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _fastpackets.floor_trips("3", 1, 1)  # type: ignore[arg-type]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:  # the limits stand as they were
        a.send(b"q" * (MAX_FRAME + 1))
        assert packets.fast_recv_packet(b) == (b"q" * (MAX_FRAME + 1), [], True)


def test_peer_credentials_name_a_uid_past_two_to_the_31_as_the_os_does() -> None:
    """A peer whose uid and gid are 2**31 or more (ids are unsigned): the same numbers os.getuid() gives, not
    negative ones that match no user."""
    require(os.geteuid() == 0, "needs root to run a peer with another uid")
    uid, gid = 2**31 + 7, 2**31 + 9
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with listener:
        listener.bind(f"\0vmmshare-peercred-{os.getpid()}")
        listener.listen()
        child = os.fork()
        if child == 0:
            try:
                os.setgid(gid)
                os.setuid(uid)
                peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                peer.connect(listener.getsockname())
                peer.recv(1)  # held open until the parent has looked
            finally:
                os._exit(0)
        sock, _ = listener.accept()
        with sock:
            try:
                assert packets.peer_credentials(sock) == (child, uid, gid)
            finally:
                sock.send(b"x")
                assert os.waitpid(child, 0)[1] == 0


# ---------------------------------------------------------------- real processes on each path


def _mapped(a: Actor, data: bytes) -> tuple[int, int]:
    """2 MiB allocated and mapped in `a`, starting with `data`: (handle, pointer)."""
    h, ret = a.call("rt.malloc_physical", MiB2, PROP, 0)
    assert ret == 0, a.last_err
    ptr, ret = a.call("rt.reserve_mem_address", MiB2, 0, 0, 0)
    assert ret == 0 and a.call("rt.map_mem", ptr, MiB2, 0, h, 0) == 0, a.last_err
    a.call("!write_bytes", ptr, data)
    return h, ptr


def _env(folder: Path, pure: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
    env["VMMSHARE_SOCKET"] = str(folder / "broker.sock")
    if pure:
        env["VMMSHARE_PURE_PYTHON"] = "1"
    return env


def _uses(env: dict[str, str]) -> str:
    """Which path a broker client of a process with `env` takes: True (compiled) or False, as text."""
    code = ("from vmmshare.client.connection import BrokerClient; from vmmshare.config import Config; "
            "from vmmshare.sockets import packets; BrokerClient(Config.from_env(), autostart=False); "
            "print(packets.FAST)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.parametrize(("broker_pure", "clients_pure"), [(False, False), (True, True), (False, True),
                                                             (True, False)],
                         ids=["compiled", "pure", "compiled-broker", "pure-broker"])
def test_share_and_refuse_between_real_processes_on_each_path(tmp_path: Path, broker_pure: bool,
                                                              clients_pure: bool) -> None:
    """A broker and two client processes, each on its path: an export, an import mapped and read back, the
    trustlist enforced, a connection used by another process than its owner refused, nothing left held."""
    if not packets.FAST_AVAILABLE and not (broker_pure and clients_pure):
        pytest.skip("the compiled fast path is not built here")
    broker = BrokerProc(tmp_path, env=_env(tmp_path, broker_pure))
    env = _env(tmp_path, clients_pure)
    assert _uses(env) == str(not clients_pure)
    exporter, importer, outsider = Actor(env), Actor(env), Actor(env)
    try:
        h, _ = _mapped(exporter, b"over either path")
        shareable, ih, iptr = share_and_map(exporter, importer, h, MiB2)
        assert importer.call("!read", iptr, 16) == b"over either path"
        _, ret = outsider.call("rt.mem_import_from_shareable_handle_v2", shareable, 1, 0)
        assert ret == NO_PERMISSION, "an import from a process off the trustlist"
        assert importer.call("rt.unmap_mem", iptr) == 0 and importer.call("rt.free_physical", ih) == 0
    finally:
        for actor in (exporter, importer, outsider):
            actor.close()
    _refuses_another_senders_request(broker)
    broker.kill()


def _refuses_another_senders_request(broker: BrokerProc) -> None:
    """A request written on this process's connection by a forked child: the broker reads the child's pid from
    the packet's credentials and refuses it; the owner is served on."""
    with rawsock.Connection(broker.socket, 30.0) as c:
        rawsock.send(c.sock, P.encode(P.BareTgid(), 1))
        data, fds, _ = rawsock.recv(c.sock)
        assert data is not None and not fds and P.decode(data).message == P.Pid(os.getpid())
        child = os.fork()
        if child == 0:
            try:
                rawsock.send(c.sock, P.encode(P.BareTgid(), 2))
            finally:
                os._exit(0)
        assert os.waitpid(child, 0)[1] == 0
        data, fds, _ = rawsock.recv(c.sock)
        assert data is not None and not fds
        reply = P.decode(data).message
        assert isinstance(reply, P.Error) and reply.code == NO_PERMISSION and f"pid {child}" in reply.message


# ---------------------------------------------------------------- VMMSHARE_PURE_PYTHON


@pytest.mark.parametrize(("value", "fast"), [("1", False), ("yes", False), (" ON ", False), ("0", True),
                                             ("off", True), ("", True)])
def test_vmmshare_pure_python_picks_the_path(tmp_path: Path, value: str, fast: bool) -> None:
    if fast and not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here")
    env = _env(tmp_path, False)
    env["VMMSHARE_PURE_PYTHON"] = value
    assert _uses(env) == str(fast)


def test_a_bad_vmmshare_pure_python_is_named_without_a_traceback(tmp_path: Path) -> None:
    env = _env(tmp_path, False)
    env["VMMSHARE_PURE_PYTHON"] = "sometimes"
    for argv in (["ls"], ["broker", "--idle", "1"]):
        done = subprocess.run([sys.executable, "-m", "vmmshare.cli", *argv], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "VMMSHARE_PURE_PYTHON='sometimes'" in done.stderr and "Traceback" not in done.stderr


def test_without_the_extension_the_pure_path_serves(tmp_path: Path) -> None:
    """Where the extension was not built, the import of vmmshare still works and packets go through Python: a
    process in which it cannot be imported shares memory with one in which it can."""
    hide = ("import importlib.abc, sys\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'vmmshare.sockets._fastpackets':\n"
            "            raise ImportError('not built')\n"
            "sys.meta_path.insert(0, Hide())\n")
    code = hide + ("import vmmshare\n"
                   "from vmmshare.sockets import packets\n"
                   "assert not packets.FAST_AVAILABLE and not packets.FAST\n"
                   "assert packets.recv_request is packets.pure_recv_request\n"
                   "mem = vmmshare.import_handle(sys.argv[1])\n"
                   "m = mem.map()\n"
                   "print(bytes(m.numpy()[:12]).decode())\n"
                   "m.close(); mem.close()\n")
    broker = BrokerProc(tmp_path, env=_env(tmp_path, False))
    env = _env(tmp_path, False)
    exporter = Actor(env)
    try:
        h, _ = _mapped(exporter, b"pure Python!")
        shareable, ret = exporter.call("rt.mem_export_to_shareable_handle_v2", h, 1, 1)  # no pid check
        assert ret == 0, exporter.last_err
        done = subprocess.run([sys.executable, "-c", code, str(shareable)], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "pure Python!"
    finally:
        exporter.close()
        broker.kill()


@pytest.mark.parametrize("extra", [0, 3])
def test_the_floors_round_trips_close_every_fd_a_reply_brings(extra: int) -> None:
    """The benchmark's floor maps the first fd of each reply; any more it brings are closed, and a reply with none
    is refused (EPROTO) with nothing kept."""
    if not packets.FAST_AVAILABLE:
        pytest.skip("the compiled fast path is not built here")
    from vmmshare.sockets import _fastpackets

    memfd = os.memfd_create("floor")
    try:
        os.ftruncate(memfd, 4096)
        before = open_fds()
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with a, b:
            for _ in range(2):  # the replies wait in the socket: the memfd and `extra` more copies of it
                socket.send_fds(b, [b"r"], [memfd] * (1 + extra))
            assert len(_fastpackets.floor_trips(a.fileno(), 2, 4096)[0]) == 2
            b.send(b"r")  # a reply with no fd
            with pytest.raises(OSError) as refused:
                _fastpackets.floor_trips(a.fileno(), 1, 4096)
            assert refused.value.errno == 71  # EPROTO
        assert open_fds() == before
    finally:
        os.close(memfd)
