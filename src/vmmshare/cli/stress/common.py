"""Shared helpers of the reliability stress scripts (faults.py, load.py, identity.py) and of their CI-sized tests.

Everything here talks to real processes: brokers from `procs.py` (`BrokerProc`), worker processes that run
`vmmshare.acl` calls, and raw SOCK_SEQPACKET connections that speak the broker protocol by hand. Loops are bounded
by a count and a deadline; waits are on pipes, replies and process exits (a few conditions can only be polled:
those polls carry a deadline too).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # the stress runs and the harness they share with the tests
TESTS = HERE  # where actor.py, procs.py, rawsock.py and fakecuda/ are
SRC = HERE.parents[2]  # the folder that holds the vmmshare package (src/ of a checkout, or site-packages)
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import fakecuda  # noqa: E402
import rawsock  # noqa: E402
from procs import PROP, Actor, BrokerProc, MiB2, clean_env, host_children  # noqa: E402
from vmmshare.cli.console import interrupt_ignored_by_children  # noqa: E402
from vmmshare.wire import local as P  # noqa: E402

__all__ = ["PROP", "Actor", "BrokerProc", "MiB2", "clean_env", "host_children"]

MiB = 1 << 20
DEFAULT, FABRIC = 1, 2
NO_PID_CHECK = 1
PARAM = 107000
BAD_HANDLE = 107017
NO_PERMISSION = 207006
NO_MEMORY = 207001
IPC_ERROR = 507022
HANG_GUARD = 30.0  # seconds: a guard against a hang only, never part of an assertion


def backend_problem(backend: str) -> str | None:
    """Why this install cannot give a run `backend` (None if it can): the CUDA backends need cuda-bindings, the CPU
    stand-in also a C compiler. Said before the run starts, as a usage error, not as a child's failure."""
    if backend == "host":
        return None
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return f"--backend {backend} needs cuda-bindings, which is not installed: pip install 'vmmshare[cuda]'"
    cc = os.environ.get("CC", "cc")
    if backend == "fakecuda" and not shutil.which(cc.split()[0] if cc.strip() else "cc"):
        return f"--backend fakecuda builds the CPU stand-in for the CUDA driver with {cc!r} ($CC), which is missing"
    return None


@contextlib.contextmanager
def backend_env(backend: str) -> Iterator[dict[str, str]]:
    """The variables that give the child `backend` (building the CPU stand-in for the driver if asked)."""
    if backend == "host":
        yield {}
        return
    if backend == "cuda":
        yield {"VMMSHARE_BACKEND": "cuda"}
        return
    folder = Path(tempfile.mkdtemp(prefix="vmmshare-fakecuda-"))
    try:
        yield {"VMMSHARE_BACKEND": "cuda", **fakecuda.build(folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Deadline:
    """A time bound for a loop that is also bounded by a count."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else max(0.0, self.end - time.monotonic())

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


# ---------------------------------------------------------------- the pattern written into shared memory


def seed_of(run_seed: int, pid: int, index: int) -> int:
    """The seed of the pattern that process `pid` writes into its `index`-th allocation in run `run_seed`."""
    return ((run_seed & 0xFFFFFFFF) << 48) ^ (pid << 24) ^ index


_PATTERNS: dict[tuple[int, int], bytes] = {}


def pattern(seed: int, size: int) -> bytes:
    """`size` bytes that only `seed` produces: a 64 KiB seeded random block, repeated (cached, a few entries)."""
    key = (seed, size)
    got = _PATTERNS.get(key)
    if got is None:
        block = random.Random(seed).randbytes(64 * 1024)
        got = block * (size // len(block)) + block[: size % len(block)]
        if len(_PATTERNS) > 64:
            _PATTERNS.clear()
        _PATTERNS[key] = got
    return got


# ---------------------------------------------------------------- raw broker connections


class Raw(rawsock.Connection):
    """One SOCK_SEQPACKET connection to a broker, speaking frames by hand (no vmmshare runtime involved)."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(path, HANG_GUARD)

    def recv(self) -> tuple[P.Frame, list[int]]:
        data, fds, _ = rawsock.recv(self.sock)
        if data is None:
            raise ConnectionResetError("the broker closed the connection")
        return P.decode(data, len(fds)), fds

    def ask(self, message: P.Message) -> Any:
        """A request and its reply message (any fd that comes with it is closed)."""
        self.req += 1
        self.sock.send(P.encode(message, self.req))
        frame, fds = self.recv()
        for fd in fds:
            os.close(fd)
        if frame.req != self.req:
            raise AssertionError(f"reply to request {frame.req}, expected {self.req}")
        return frame.message


def barrier(path: Path | str) -> None:
    """Return once the broker at `path` has seen every connection close that happened before this call.

    A close that happened before our connect is reported no later than the select pass that accepts us, and a
    request of ours is served in a later pass: so the reply to it comes after the broker dropped the dead client.
    """
    with Raw(path) as c:
        for _ in range(2):
            reply = c.ask(P.BareTgid())
            assert isinstance(reply, P.Pid), reply


def settled_fd_count(broker: BrokerProc) -> int:
    """The broker's open fds once it has processed every earlier close (counted with one raw connection open)."""
    with Raw(broker.socket) as c:
        for _ in range(2):
            assert isinstance(c.ask(P.BareTgid()), P.Pid)
        return broker.fd_count()


def raw_mem_info(path: Path | str, device: int = 0) -> tuple[int, int]:
    """(free, total) of `device` as the broker at `path` accounts it."""
    with Raw(path) as c:
        reply = c.ask(P.MemInfo(device))
        assert isinstance(reply, P.Mem), reply
        return reply.free, reply.total


def raw_listing(path: Path | str) -> dict[str, Any]:
    """What `vmmshare ls --json` shows, read page by page over a raw connection (each page's rows and its devices'
    figures joined, as the command joins them)."""
    rows: list[Any] = []
    head: dict[str, Any] = {}
    used: dict[str, int] = {}
    gpu_used: dict[str, int] = {}
    with Raw(path) as c:
        offset: int | None = 0
        for _ in range(100_000):
            if offset is None:
                break
            reply = c.ask(P.List(offset))
            assert isinstance(reply, P.Listing), reply
            page = json.loads(reply.page)
            rows.extend(page.pop("exports"))
            used.update(page.pop("used", {}))
            gpu_used.update(page.pop("gpu_used", {}))
            offset = page.pop("next")
            head = page
    head.update(exports=rows, used=used, gpu_used=gpu_used)
    return head


def actor_mem_info(env: dict[str, str], device: int = 0) -> tuple[int, int]:
    """(free, total) from `get_mem_info` in a fresh process (an Actor), as a user of the node sees it."""
    a = Actor(env, device=device)
    try:
        free, total, ret = a.call("rt.get_mem_info", 0)
        assert ret == 0, f"get_mem_info failed ({ret}): {a.last_err}"
        return int(free), int(total)
    finally:
        a.close()
        a.kill()


@contextlib.contextmanager
def start_lock(broker: BrokerProc) -> Iterator[None]:
    """Hold the broker start lock of `broker`'s socket folder.

    A client that finds no broker takes this lock before it starts one (SPEC §5, race-free auto-start); while we
    hold it, clients that lost their broker wait, so that a broker restarted by `BrokerProc.start()` gets the
    socket, and they reconnect to it by themselves once we let go.
    """
    fd = os.open(broker.folder / "broker.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class LoggedBroker(BrokerProc):
    """A BrokerProc whose log (stderr) goes to `log` and whose log level is chosen, so tests can read it."""

    def __init__(self, folder: Path, *extra: str, env: dict[str, str] | None = None, log: Path | None = None,
                 level: str = "WARNING") -> None:
        self.log = log or folder.parent / f"{folder.name}.broker.log"
        self.level = level
        super().__init__(folder, *extra, env=env)

    def start(self) -> None:
        rfd, wfd = os.pipe()
        cmd = [sys.executable, "-m", "vmmshare.broker", "--socket", str(self.socket), "--ready-fd", str(wfd),
               "--log-level", self.level, *self.extra]
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(cmd, env=self.env, pass_fds=(wfd,), stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=logf)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            line = r.readline()
        if line != b"ready\n":
            self.proc.wait(10)
            raise RuntimeError(f"broker failed to start (exit {self.proc.returncode}); see {self.log}")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


# ---------------------------------------------------------------- processes


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")


def processes_mentioning(marker: str, exclude: Iterable[int] = ()) -> list[tuple[int, str]]:
    """Live processes whose command line or environment mentions `marker` (e.g. a run's temporary folder)."""
    skip = {os.getpid(), *exclude}
    found = []
    needle = marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    environ = f.read()
            except OSError:
                environ = b""
        except OSError:
            continue
        if (needle in cmd or needle in environ) and not gone(int(name)):
            found.append((int(name), cmd.replace(b"\0", b" ").decode(errors="replace")[:200]))
    return found


def wait_gone(pid: int, limit: float = HANG_GUARD) -> bool:
    """Wait (bounded) until a process that need not be our child has exited; True when it has."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:
        deadline = Deadline(limit)
        while not gone(pid) and not deadline.passed():
            time.sleep(0.01)  # no pidfd on this kernel: poll the condition, bounded
        return gone(pid)
    try:
        select.select([pidfd], [], [], limit)
    finally:
        os.close(pidfd)
    return gone(pid)


class Worker:
    """A child process driven by JSON lines on stdin, answering with JSON lines (events) on stdout."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str = "", pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name or argv[-1]
        with interrupt_ignored_by_children():  # until its `entry` runs: Ctrl-C is the run's to report
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                         pass_fds=pass_fds, close_fds=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.fd = self.proc.stdout.fileno()
        self.pid = self.proc.pid
        self._buf = b""
        self._lines: list[dict[str, Any]] = []
        self.eof = False

    def send(self, obj: dict[str, Any]) -> bool:
        """Send one command; False when the worker is gone."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            return True
        except (BrokenPipeError, ValueError):
            return False

    def fill(self) -> None:
        """Read what is there (call when the fd is readable)."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.eof = True
            return
        self._buf += data
        *whole, self._buf = self._buf.split(b"\n")
        self._lines.extend(json.loads(line) for line in whole if line.strip())

    def take(self) -> list[dict[str, Any]]:
        out, self._lines = self._lines, []
        return out

    def next(self, limit: float = HANG_GUARD) -> dict[str, Any] | None:
        """The next event; None at EOF. Raises TimeoutError past `limit` (a hang guard)."""
        deadline = Deadline(limit)
        while not self._lines:
            if self.eof:
                return None
            ready, _, _ = select.select([self.fd], [], [], deadline.left())
            if not ready:
                raise TimeoutError(f"{self.name} (pid {self.pid}) did not answer within {limit:.0f} s")
            self.fill()
        return self._lines.pop(0)

    def until(self, ev: str, limit: float = HANG_GUARD) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Read events up to the first one named `ev`; returns it and the events before it."""
        before: list[dict[str, Any]] = []
        deadline = Deadline(limit)
        for _ in range(1_000_000):
            got = self.next(deadline.left())
            if got is None:
                raise RuntimeError(f"{self.name} (pid {self.pid}) exited (rc {self.proc.wait(10)}) before {ev!r}; "
                                   f"last events: {before[-5:]}")
            if got.get("ev") == ev:
                return got, before
            before.append(got)
        raise RuntimeError("unreachable")

    def call(self, obj: dict[str, Any], ev: str, limit: float = HANG_GUARD) -> dict[str, Any]:
        """Send a command and return the event that answers it (events before it must not exist)."""
        if not self.send(obj):
            raise RuntimeError(f"{self.name} (pid {self.pid}) is gone (rc {self.proc.wait(10)})")
        got, before = self.until(ev, limit)
        assert not before, f"{self.name}: unexpected events before {ev!r}: {before[:5]}"
        return got

    def kill(self) -> None:
        """SIGKILL; what it wrote before dying stays readable with `take()`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(HANG_GUARD)
        self._drain()
        self._close_pipes()

    def _drain(self) -> None:
        """Read what a dead worker left in its pipe (its write end is closed: EOF comes)."""
        for _ in range(100_000):
            if self.eof or self.proc.stdout is None or self.proc.stdout.closed:
                return
            ready, _, _ = select.select([self.fd], [], [], HANG_GUARD)
            if not ready:
                return
            self.fill()

    def close(self, limit: float = HANG_GUARD) -> int:
        """Close stdin (the worker frees what it holds and exits) and wait; SIGKILL past the guard."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            rc = self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(HANG_GUARD)
        self._drain()
        self._close_pipes()
        return rc

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


# ---------------------------------------------------------------- shared progress counters (kill points)


class Progress:
    """A 16-byte shared file: a worker bumps (ops, phase) before each step; the controller reads it to kill the
    worker after a random number of operations and to record which operation the kill interrupted."""

    FMT = struct.Struct("<QI4x")

    def __init__(self, path: Path, create: bool = False) -> None:
        import mmap

        self.path = path
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, 4096)
            self.map = mmap.mmap(fd, 4096)
        finally:
            os.close(fd)
        self.ops = 0

    def step(self, phase: int) -> None:
        self.ops += 1
        self.FMT.pack_into(self.map, 0, self.ops, phase)

    def read(self) -> tuple[int, int]:
        ops, phase = self.FMT.unpack_from(self.map, 0)
        return int(ops), int(phase)

    def close(self) -> None:
        self.map.close()


# ---------------------------------------------------------------- numbers


def percentiles(values_us: list[float]) -> dict[str, float]:
    """count, p50, p99, max of a list of microsecond latencies (nearest-rank)."""
    if not values_us:
        return {"count": 0}
    s = sorted(values_us)

    def rank(q: float) -> float:
        return round(s[min(len(s) - 1, max(0, int(q * len(s) + 0.999999) - 1))], 1)

    return {"count": len(s), "p50_us": rank(0.50), "p99_us": rank(0.99), "max_us": round(s[-1], 1)}


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write the run's result as JSON to `path` ("-" for stdout)."""
    text = json.dumps(result, indent=2, sort_keys=True)
    if path == "-":
        print(text)
    elif path:
        Path(path).write_text(text + "\n")


def machine() -> dict[str, Any]:
    """A few facts about where a run happened, for the record."""
    return {"cpus": os.cpu_count(), "kernel": os.uname().release, "python": sys.version.split()[0],
            "clk_tck": os.sysconf("SC_CLK_TCK")}
