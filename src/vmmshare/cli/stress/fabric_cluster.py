"""Test clusters for the fabric tests: servers as network namespaces (vmmshare cluster), each with its own broker
started here (so a test can kill, freeze or restart it) and actors running `vmmshare.acl` calls on that server."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from procs import Actor, clean_env
from vmmshare.cli.cluster import Cluster
from vmmshare.fabric.engine import missing

_names = itertools.count(1)
HANG_GUARD = 60.0  # seconds: only a guard against a hang, never part of a result


def cluster_problem() -> str:
    """Why a test cluster cannot be made here ("" when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    return missing()


class ClusterBroker:
    """A broker on server `n`, started in its namespace with its settings."""

    def __init__(self, cluster: TestCluster, n: int, env: dict[str, str]) -> None:
        self.cluster, self.n, self.env = cluster, n, env
        self.socket = Path(env["VMMSHARE_SOCKET"])
        self.log = self.socket.parent / "broker.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, **extra: str) -> None:
        rfd, wfd = os.pipe()
        server = self.cluster.cluster.server(self.n)
        cmd = server.command([sys.executable, "-m", "vmmshare.broker", "--socket", str(self.socket),
                              "--ready-fd", str(wfd), "--log-level", "DEBUG"], **extra)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env={**self.env, **extra}, pass_fds=(wfd,), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            line = r.readline()
        if line != b"ready\n":
            self.proc.wait(10)
            raise RuntimeError(f"broker on server {self.n} failed to start (exit {self.proc.returncode}):\n"
                               + self.log.read_text()[-2000:])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(30)
        elif sig == signal.SIGSTOP:  # stopped only once every thread is (its engine's too): a request sent before
            eventually(self._stopped, "the broker did not stop")  # that could still be answered

    def _stopped(self) -> bool:
        """Whether every thread of the broker is stopped (state T in /proc)."""
        try:
            tasks = os.listdir(f"/proc/{self.pid}/task")
            states = []
            for t in tasks:
                with open(f"/proc/{self.pid}/task/{t}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            return False
        return all(state == "T" for state in states)

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def memfd_mappings(self) -> int:
        """Mappings of memfds in the broker: those it serves to other servers."""
        with open(f"/proc/{self.pid}/maps") as f:
            return sum(1 for line in f if "/memfd:" in line)

    def listing(self) -> dict[str, Any]:
        """What `vmmshare ls --json` shows on this server: the same query, made from this process (the broker's
        socket is a file, reachable from any network namespace), not from a `vmmshare ls` of its own."""
        import common

        return common.raw_listing(self.socket)


class TestCluster:
    """`servers` servers with their brokers up; `close()` stops everything and removes the namespaces."""

    __test__ = False

    def __init__(self, servers: int = 2, timeout: float = 1.0, brokers: bool = True) -> None:
        self.servers, self.timeout, self.with_brokers = servers, timeout, brokers
        self.surfaces: dict[int, str] = {}  # server -> the surface its actors call ("python" or "c")
        self.root = Path(tempfile.mkdtemp(prefix="vmc", dir="/tmp"))
        name = f"t{os.getpid() % 10000}x{next(_names)}"[:8]
        self.cluster = Cluster(name, servers, root=self.root, timeout=timeout)
        self.cluster.up()
        self.actors: list[Actor] = []
        self.brokers = {s.number: ClusterBroker(self, s.number, self.env(s.number)) for s in self.cluster.servers}
        try:
            if brokers:
                for b in self.brokers.values():
                    b.start()
        except BaseException:
            self.close()
            raise

    def env(self, n: int, **extra: str) -> dict[str, str]:
        """The environment of a process on server `n` (its VMMSHARE_* settings; brokers are started by the test)."""
        return clean_env(**{**self.cluster.server(n).env, "VMMSHARE_BROKER_IDLE": "600", **extra})

    def server_id(self, n: int) -> int:
        return self.cluster.server(n).server_id

    def actor(self, n: int, **extra: str) -> Actor:
        """A process on server `n` running acl calls (device 0 set), on the surface `surfaces` names for that server
        (vmmshare.acl by default, or the C library: "c") unless `extra` names one."""
        extra = {"VMMSHARE_ACTOR_SURFACE": self.surfaces.get(n, "python"), **extra}
        a = Actor(self.env(n, **extra), prefix=["ip", "netns", "exec", self.cluster.server(n).namespace])
        self.actors.append(a)
        return a

    def run(self, n: int, code: str, **extra: str) -> subprocess.CompletedProcess[str]:
        """Run Python `code` on server `n`."""
        cmd = self.cluster.server(n).command([sys.executable, "-c", code], **extra)
        return subprocess.run(cmd, env=self.env(n, **extra), capture_output=True, text=True, timeout=HANG_GUARD)

    def logs(self) -> str:
        return "\n".join(f"--- broker {b.n}\n{b.log.read_text()[-3000:] if b.log.exists() else ''}"
                         for b in self.brokers.values())

    def renew(self) -> None:
        """Close this cluster and bring up a fresh one like it in its place (new namespaces, brokers, key)."""
        self.close()
        self.__init__(self.servers, self.timeout, self.with_brokers)  # type: ignore[misc]

    def holdings(self) -> dict[int, dict[str, Any]]:
        """What each broker holds and serves (call it once the test's processes are gone): whether it is alive, its
        clients (other than the connection that asks), charges, exports and memfds mapped for other servers."""
        import common

        out: dict[int, dict[str, Any]] = {}
        for n, b in self.brokers.items():
            if not b.alive():
                out[n] = {"alive": False}
                continue
            common.barrier(b.socket)  # it has dropped every client that was gone before this call
            listed = common.raw_listing(b.socket)
            out[n] = {"alive": True, "clients": listed["clients"], "used": listed["used"],
                      "gpu_used": listed["gpu_used"], "exports": listed["exports"], "served": b.memfd_mappings()}
        return out

    def unchanged(self) -> bool:
        """Whether every broker is alive and holds and serves nothing (see `holdings`)."""
        idle = {"alive": True, "clients": 0, "used": {}, "gpu_used": {}, "exports": [], "served": 0}
        return all(h == idle for h in self.holdings().values())

    def close(self) -> None:
        for a in self.actors:
            a.kill()
        for b in self.brokers.values():
            if b.alive():
                os.kill(b.pid, signal.SIGCONT)
        self.cluster.down()
        shutil.rmtree(self.root, ignore_errors=True)


def eventually(check: Callable[[], bool], what: str, guard: float = HANG_GUARD) -> None:
    """Wait until `check()` holds (polling); fail with `what` if it does not within the hang guard."""
    deadline = time.monotonic() + guard
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {guard:.0f} s"
        time.sleep(0.05)
