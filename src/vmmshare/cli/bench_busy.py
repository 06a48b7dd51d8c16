"""What `vmmshare bench` measures of the waits: the 2 MiB share and the broker's import + free round trips with the
polling windows on (the defaults) and off, each on a private broker of its own, on the idle machine and with every
usable core kept busy by CPU hogs, so that "a wait spins only while a core is free for it" is a measured claim.

Both ends read their polling window once per process (config.py), the broker at its start: so each setting gets
its own broker (VMMSHARE_BROKER_SPIN_US) and its own measuring processes (VMMSHARE_SPIN_US, VMMSHARE_SOCKET), all
started for the pass and all stopped at its end, with the socket folder removed; the default broker is untouched.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import multiprocessing as mp
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..config import BROKER_SPIN_US, CLIENT_SPIN_US
from .bench_broker import cpu_of
from .bench_measures import MiB, Step, peer_main, quiet, share_rounds, stats_of
from .console import quiet_child, start_child

LOADS = ("idle", "busy")  # the machine as it is, then with one CPU hog per usable core
SPINS = ("on", "off")
WINDOWS_US = {"on": (CLIENT_SPIN_US, BROKER_SPIN_US), "off": (0, 0)}  # (client's, broker's) polling window, µs
SIZE = 2 * MiB
KEPT = ("import", "reserve_map", "shm_attach", "share", "shm_share")  # the steps of share_rounds a pass keeps
ORDER = ("on", "off", "off", "on")  # each load's halves of a pass: neither setting always goes first, or last
START_TIMEOUT = 30.0  # seconds a private broker may take to serve
STOP_TIMEOUT = 10.0  # seconds a stopped process may take to exit before it is killed
BROKER_IDLE = 60  # seconds: a private broker whose bench died (with every client) exits on its own after this
PR_SET_PDEATHSIG = 1

# A CPU hog: burns its core at normal priority until killed; Ctrl-C is the bench's to handle (it kills the hog), and
# the kernel kills the hog if the bench dies first. It says it runs with one byte on stdout.
_HOG = ("import ctypes, os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, signal.SIGKILL)\n"
        "if os.getppid() != int(sys.argv[1]):\n"
        "    raise SystemExit(0)\n"
        "os.write(1, b'!')\n"
        "os.close(1)\n"
        "while True:\n"
        "    pass\n")


class PassError(RuntimeError):
    """The waits pass could not run (a private broker or a hog did not start); the message says why."""


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when `parent`, which started it, ends (however it ends), so that a
    measuring process never outlives the bench; exits at once if `parent` is already gone."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


# ---------------------------------------------------------------- the load


@contextlib.contextmanager
def hogs(n: int) -> Iterator[list[int]]:
    """`n` processes that only burn CPU at normal priority, each running before this yields their pids; all killed
    and reaped on the way out, whatever ends the block (an error, Ctrl-C)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-I", "-S", "-c", _HOG, str(os.getpid())],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL))
        for p in procs:
            assert p.stdout is not None
            if p.stdout.read(1) != b"!":
                raise PassError(f"a CPU hog (pid {p.pid}) exited ({p.wait()}) before it ran")
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()  # a no-op for one already reaped
        for p in procs:
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


# ---------------------------------------------------------------- a private broker


@contextlib.contextmanager
def private_brokers(folder: Path, spins_us: dict[str, int]) -> Iterator[dict[str, tuple[Path, int]]]:
    """A broker of its own for each name in `spins_us`, serving `folder`/name.sock with VMMSHARE_BROKER_SPIN_US set
    to its value (and no fabric), all started at once: yields each one's socket path and pid once all serve; each
    stopped (SIGTERM, then SIGKILL) and reaped on the way out."""
    started: list[tuple[str, subprocess.Popen[bytes], int, Path]] = []
    try:
        for name, spin_us in spins_us.items():
            path, log_path = folder / f"{name}.sock", folder / f"{name}.log"
            env = {**os.environ, "VMMSHARE_BROKER_SPIN_US": str(spin_us), "VMMSHARE_FABRIC": "off"}
            for inherited in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):  # never a socket-activated listener
                env.pop(inherited, None)
            rfd, wfd = os.pipe2(os.O_CLOEXEC)
            try:
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "vmmshare.broker", "--socket", str(path), "--idle", str(BROKER_IDLE),
                         "--ready-fd", str(wfd)], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                        pass_fds=(wfd,), env=env, start_new_session=True)  # Ctrl-C is the bench's: it stops it
            except OSError as exc:
                os.close(rfd)
                raise PassError(f"cannot start a private broker: {exc.strerror or exc}") from None
            finally:
                os.close(wfd)
            started.append((name, proc, rfd, log_path))
        for _, proc, rfd, log_path in started:
            _wait_ready(proc, rfd, log_path)
        yield {name: (folder / f"{name}.sock", proc.pid) for name, proc, _, _ in started}
    finally:
        for _, proc, rfd, _ in started:
            os.close(rfd)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _, _ in started:
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], rfd: int, log_path: Path) -> None:
    """Wait (at most START_TIMEOUT) for the broker's "ready" line on `rfd`; PassError, with its log, if none."""
    deadline = time.monotonic() + START_TIMEOUT
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        chunk = os.read(rfd, 64) if left > 0 and select.select([rfd], [], [], left)[0] else None
        if not chunk:
            if chunk is None:
                proc.kill()
            code = proc.wait()
            try:
                said = log_path.read_text(errors="replace").strip().splitlines()[-1:]
            except OSError:
                said = []
            raise PassError(f"a private broker did not start (exit status {code})" + (f": {said[0]}" if said else ""))
        line += chunk


# ---------------------------------------------------------------- the measuring processes


def _orphan_proof(parent: int, target: Any, *args: Any) -> None:
    """A forked measuring process's body: `target(*args)`, killed by the kernel if its driver ends first."""
    die_with_parent(parent)
    target(*args)


def _client(conn: Connection) -> None:
    """A throughput client: on each ("run", handle, deadline) it imports and frees the handle until the deadline
    and answers (round trips, its CPU seconds, when it stopped); None ends it."""
    import vmmshare

    rt = vmmshare.acl.rt
    rt.set_device(0)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        _, text, deadline = msg
        value = int(vmmshare.ShareableHandle.parse(text))
        n = 0
        cpu0 = _cpu_self()
        while True:
            handle, ret = rt.mem_import_from_shareable_handle_v2(value, 1, 0)
            if ret or rt.free_physical(handle):
                raise SystemExit(f"import+free failed: {vmmshare.acl.get_recent_err_msg()}")
            n += 1
            if time.perf_counter() >= deadline:
                break
        conn.send((n, _cpu_self() - cpu0, time.perf_counter()))


def _cpu_self() -> float:
    t = os.times()
    return t.user + t.system


def driver_main(conn: Connection, env: dict[str, str], parent: int, broker: int, clients: int) -> None:
    """One polling setting's measuring process: with `env` (its broker's socket, its client window) set before its
    runtime exists, it forks the peer and `clients` throughput clients (which inherit both), then answers each
    ("measure", rounds, seconds, counts) with what it measured (each round's µs by step, and each point's round
    trips, seconds and CPU seconds) until ("stop",) or its pipe closes."""
    os.environ.update(env)
    die_with_parent(parent)
    # the runtime's modules, imported before the forks: the children share the imports, not the runtime (each
    # makes its own after them, with the environment above)
    import vmmshare
    import vmmshare._process
    import vmmshare.acl.rt

    me = os.getpid()
    fork = mp.get_context("fork")
    peer_conn, there = fork.Pipe()
    peer = fork.Process(target=quiet_child, args=(_orphan_proof, me, peer_main, there))
    start_child(peer)
    pipes: list[Connection] = []
    procs = [peer]
    try:
        for _ in range(clients):
            a, b = fork.Pipe()
            p = fork.Process(target=quiet_child, args=(_orphan_proof, me, _client, b))
            start_child(p)
            pipes.append(a)
            procs.append(p)
        vmmshare.acl.rt.set_device(0)
        peer_pid = peer_conn.recv()
        with vmmshare.Device(0).allocate(SIZE) as mem:
            text = str(mem.export(validate_pids=False))
            _round(pipes, text, 0.0)  # each client connects and warms up
            conn.send("ready")
            while True:
                try:
                    msg = conn.recv()
                except EOFError:
                    return
                if msg[0] == "stop":
                    return
                _, reps, seconds, counts = msg
                steps: dict[str, list[float]] = collections.defaultdict(list)
                share_rounds(peer_conn, peer_pid, SIZE, reps, False, steps)
                out: dict[str, Any] = {"latency": {k: steps[k] for k in KEPT}, "throughput": {}}
                for n in counts:
                    cpu_b = cpu_of(broker)
                    t0 = time.perf_counter()
                    done = _round(pipes[:n], text, t0 + seconds)
                    out["throughput"][str(n)] = {
                        "ops": sum(d[0] for d in done), "elapsed": max(d[2] for d in done) - t0,
                        "client_cpu": sum(d[1] for d in done), "broker_cpu": cpu_of(broker) - cpu_b}
                conn.send(out)
    finally:
        for a in pipes:
            with contextlib.suppress(OSError):
                a.send(None)
        with contextlib.suppress(OSError):
            peer_conn.send(("stop",))
        for p in procs:
            p.join(STOP_TIMEOUT)
            if p.exitcode is None:
                p.kill()
                p.join()


def _round(pipes: list[Connection], text: str, deadline: float) -> list[tuple[int, float, float]]:
    """Start every client's run of import + free round trips until `deadline` and collect what each did."""
    for a in pipes:
        a.send(("run", text, deadline))
    return [a.recv() for a in pipes]


@contextlib.contextmanager
def drivers(specs: dict[str, tuple[Path, int, int]], clients: int) -> Iterator[dict[str, Connection]]:
    """For each name in `specs` (a broker's socket path and pid, and the client window in µs), a measuring process
    (driver_main) reaching that broker with VMMSHARE_SPIN_US set to the window, all started at once: yields the
    pipe to each once all and their clients are ready; each told to stop and reaped on the way out."""
    ctx = mp.get_context("spawn")
    started: list[tuple[str, Connection, Any]] = []
    try:
        for name, (path, broker, client_us) in specs.items():
            a, b = ctx.Pipe()
            env = {"VMMSHARE_SOCKET": str(path), "VMMSHARE_SPIN_US": str(client_us)}
            proc = ctx.Process(target=quiet_child, args=(driver_main, b, env, os.getpid(), broker, clients))
            start_child(proc)
            b.close()  # its end lives in the driver: if it dies, recv() here sees the pipe close
            started.append((name, a, proc))
        for _, a, _ in started:
            a.recv()
        yield {name: a for name, a, _ in started}
    finally:
        for _, a, _ in started:
            with contextlib.suppress(OSError):
                a.send(("stop",))
            a.close()
        for _, _, proc in started:
            proc.join(STOP_TIMEOUT)
            if proc.exitcode is None:
                proc.kill()
                proc.join()


# ---------------------------------------------------------------- the pass


def importer(latency: dict[str, Any]) -> float:
    """The importer's side of a 2 MiB share (import + reserve + map), µs, medians."""
    return float(latency["import"]["median"] + latency["reserve_map"]["median"])


def _joined(halves: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's figures under one load, from the halves of its pass: each step's median and spread over every
    round, each point's round trips/s and CPU per round trip over both halves, and the ratios to the anchors."""
    lat = {k: stats_of([v for h in halves for v in h["latency"][k]]) for k in KEPT}
    tp: dict[str, Any] = {}
    for n in halves[0]["throughput"]:
        ops = sum(h["throughput"][n]["ops"] for h in halves)
        tp[n] = {"ops_per_s": ops / sum(h["throughput"][n]["elapsed"] for h in halves),
                 "client_cpu_us": sum(h["throughput"][n]["client_cpu"] for h in halves) / ops * 1e6,
                 "broker_cpu_us": sum(h["throughput"][n]["broker_cpu"] for h in halves) / ops * 1e6}
    return {"latency": lat, "throughput": tp, "importer_vs_attach": importer(lat) / lat["shm_attach"]["median"],
            "share_vs_shm": lat["share"]["median"] / lat["shm_share"]["median"]}


def waits(reps: int, seconds: float, counts: list[int], step: Step = quiet) -> dict[str, Any]:
    """The pass: for each load (idle, then one hog per usable core) and each polling setting (the default windows,
    then none), the 2 MiB share by step with its SharedMemory anchors, and import + free round trips with
    `counts` clients for `seconds` each, with the CPU one round trip costs the clients and the broker; `reps`
    rounds and `seconds` per point in two halves, in the order ORDER. Every broker, hog and measuring process it
    starts is gone, and its socket folder removed, when it returns."""
    began = time.perf_counter()
    cores = len(os.sched_getaffinity(0))
    folder = Path(tempfile.mkdtemp(prefix="vmmshare-bench-"))  # 0700, this user's: the client trusts it
    passes: dict[str, dict[str, Any]] = {load: {} for load in LOADS}
    made: dict[str, list[int]] = {"brokers": [], "hogs": []}
    try:
        step("waits: a private broker and its measuring processes for each of spins on and off")
        with contextlib.ExitStack() as stack:
            brokers = stack.enter_context(private_brokers(folder, {s: WINDOWS_US[s][1] for s in SPINS}))
            made["brokers"] += [pid for _, pid in brokers.values()]
            measuring = stack.enter_context(drivers({s: (*brokers[s], WINDOWS_US[s][0]) for s in SPINS},
                                                    max(counts)))
            for load in LOADS:
                load_now: contextlib.AbstractContextManager[list[int]] = (
                    hogs(cores) if load == "busy" else contextlib.nullcontext([]))
                with load_now as hog_pids:
                    made["hogs"] += hog_pids
                    halves = []
                    for spins in ORDER:  # on and off in the same minute, under the same load
                        step(f"waits: {load} machine, spins {spins}")
                        measuring[spins].send(("measure", -(-reps // 2), seconds / 2, counts))
                        halves.append((spins, measuring[spins].recv()))
                    for spins in SPINS:
                        passes[load][spins] = _joined([got for s, got in halves if s == spins])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"size": SIZE, "cores": cores, "hogs": cores, "reps": reps, "seconds": seconds, "clients": counts,
            "order": list(ORDER), "took_s": time.perf_counter() - began,
            "windows_us": {s: {"client": c, "broker": b} for s, (c, b) in WINDOWS_US.items()},
            "passes": passes,
            "spins_on_vs_off": {load: importer(passes[load]["on"]["latency"]) /
                                importer(passes[load]["off"]["latency"]) for load in LOADS},
            "started": {"folder": str(folder), "broker_pids": made["brokers"], "hog_pids": made["hogs"]}}
