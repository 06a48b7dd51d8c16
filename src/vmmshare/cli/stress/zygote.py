"""A fork server for the harness's Python children: one process that has imported `vmmshare.acl` forks each child.

Starting a Python child and importing vmmshare costs about 0.15 s of CPU; a test suite starts hundreds (actors,
`python -c` children). The zygote pays it once: for each child it forks itself, and the child takes the stdio,
environment and working folder it was given, then runs its job (an actor, or code as ``python -c`` would). The
zygote has made no runtime, connection or thread before it forks (importing vmmshare makes none), so each child
is a new process with a runtime of its own, as after an exec.

The zygote is the children's parent: it reaps each one and writes its exit status (as `subprocess` reports it:
the exit code, or minus the signal) to a pipe the caller gave with the job; the caller signals a child through a
pidfd (no pid-reuse race). `ZygoteChild` offers what the harness uses of `subprocess.Popen`.

Run as ``python zygote.py FD [MODULE...]``: FD is its end of a SOCK_SEQPACKET pair; it imports the MODULEs too,
and answers ``ready`` once it can fork.
"""

from __future__ import annotations

import array
import contextlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Any

_FDS = 4  # with each job: its stdin, stdout, stderr and the write end of its status pipe


def _serve(sock: socket.socket) -> dict[str, Any]:
    """The zygote's loop: fork a child per job, reap children and report how they ended. Returns only in a child,
    with its job; ends the zygote (exit 0) once the caller closes its end."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd hears of each exit
    status_of: dict[int, int] = {}  # child pid -> the write end of its status pipe
    sock.send(b"ready")
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(status_of)
        if sock not in ready:
            continue
        fds = array.array("i")
        msg, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(_FDS * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if not msg:
            return {"kind": "quit"}
        job = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            sock.detach()  # its fd is closed below; the object must not close a later fd of that number
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for i, fd in enumerate(fds[:3]):
                os.dup2(fd, i, inheritable=True)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as Popen's close_fds: only stdio goes with the child
            return job
        for fd in fds[:3]:
            os.close(fd)
        status_of[pid] = fds[3]
        pidfd = os.pidfd_open(pid)
        try:
            sock.sendmsg([str(pid).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pidfd]))])
        finally:
            os.close(pidfd)


def _reap(status_of: dict[int, int]) -> None:
    while status_of:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_of.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):  # the caller may be gone
                os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
            os.close(fd)


def _run(job: dict[str, Any]) -> None:
    """A child's life: its environment, folder and stdio, then its job; the interpreter's own exit follows."""
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), line_buffering=True,
                                  errors="backslashreplace")
    if job["kind"] == "actor":
        import actor

        sys.argv = [actor.__file__]
        try:
            actor.main()
        except KeyboardInterrupt:
            sys.exit(130)
    else:  # as `python -c CODE`: argv ["-c"], the working folder first on sys.path
        sys.argv = ["-c"]
        sys.path[0] = ""
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        try:
            exec(compile(job["code"], "<string>", "exec"), main.__dict__)
        except Exception as exc:  # reported as the interpreter would: from the code's own frame on
            own = exc.__traceback__.tb_next if exc.__traceback__ else None
            sys.excepthook(type(exc), exc.with_traceback(own), own)
            sys.exit(1)


class ZygoteChild:
    """A child forked by the zygote, with the part of `subprocess.Popen` the harness uses."""

    def __init__(self, pid: int, pidfd: int, status: int, stdin: IO[str] | None, stdout: IO[str] | None,
                 stderr: IO[str] | None) -> None:
        self.pid, self._pidfd, self._status = pid, pidfd, status
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired("zygote child", timeout or 0.0)
        return code

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], timeout)[0]:
            raw = os.read(self._status, 64)
            self.returncode = int(raw) if raw else -signal.SIGKILL  # no status: the zygote died first
            os.close(self._status)
            os.close(self._pidfd)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited; the zygote is about to report it
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything the child writes to its stdout and stderr pipes until it exits (its stdin closed first):
        `Popen.communicate` without input. On timeout the child is killed and TimeoutExpired raised."""
        if self.stdin is not None:
            self.stdin.close()
        pipes = [s for s in (self.stdout, self.stderr) if s is not None]
        got: dict[int, list[bytes]] = {s.fileno(): [] for s in pipes}
        open_fds = set(got)
        deadline = None if timeout is None else time.monotonic() + timeout
        while open_fds:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(list(open_fds), [], [], left)[0]
            if not ready:
                self.kill()
                self.wait()
                raise subprocess.TimeoutExpired("zygote child", timeout or 0.0)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    got[fd].append(chunk)
                else:
                    open_fds.discard(fd)
        texts = [b"".join(got[s.fileno()]).decode(errors="replace") for s in pipes]
        for s in pipes:
            s.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = texts.pop(0) if self.stdout is not None else ""
        return out, texts.pop(0) if self.stderr is not None else ""


class Zygote:
    """The caller's side: starts the zygote with `env` and forks children from it."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        self.env = dict(env)
        self.preload = preload
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.set_inheritable(False)
        self._proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno()), *preload], env=self.env,
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = mine
        if mine.recv(16) != b"ready":
            self._proc.wait(30)
            raise RuntimeError(f"the zygote failed to start (exit {self._proc.returncode})")

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a child with `env` can come from this zygote: what the interpreter (PYTHON*) and the dynamic
        loader (LD_*: LD_LIBRARY_PATH is read once, at exec) take from the environment is fixed at its start."""
        def fixed(e: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k.startswith(("PYTHON", "LD_"))}

        return fixed(env) == fixed(self.env)

    def spawn(self, job: dict[str, Any], env: dict[str, str], stderr_pipe: bool = False) -> ZygoteChild:
        """Fork a child for `job` ({"kind": "actor"} or {"kind": "code", "code": ...}) with pipes for its stdin and
        stdout (and stderr when asked; else it shares the caller's)."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if stderr_pipe else (-1, os.dup(2))
        st_r, st_w = os.pipe()
        try:
            msg = json.dumps({**job, "env": env, "cwd": os.getcwd()}).encode()
            fds = array.array("i", [in_r, out_w, err_w, st_w])
            self._sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            reply, anc, _, _ = self._sock.recvmsg(64, socket.CMSG_SPACE(4))
            pidfd = next(int.from_bytes(data[:4], sys.byteorder) for lvl, kind, data in anc
                         if lvl == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS)
        except BaseException:
            for fd in (in_w, out_r, err_r, st_r):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w, st_w):
                os.close(fd)
        return ZygoteChild(int(reply), pidfd, st_r, open(in_w, "w", buffering=1), open(out_r),
                           open(err_r) if err_r >= 0 else None)

    def close(self) -> None:
        self._sock.close()
        self._proc.wait(30)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    import importlib

    import actor  # noqa: F401  (imports vmmshare.acl: what every child would import first)
    import vmmshare._process  # noqa: F401

    for name in sys.argv[2:]:  # more modules its children import (torch: about 1.5 s of CPU each time)
        importlib.import_module(name)

    job = _serve(sock)
    if job["kind"] == "quit":
        return
    _run(job)


if __name__ == "__main__":
    main()
