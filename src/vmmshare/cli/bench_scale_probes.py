"""What `vmmshare bench --fabric --servers N` reads of the servers' processes from /proc: CPU by process, thread
and part, memory, and what a run left behind (namespaces, processes, /dev/shm entries)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

KiB = 1 << 10


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all its threads), or of its thread `tid`; 0 once it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _on_cpu(pid: int, tid: int) -> float:
    """Seconds thread `tid` of `pid` has run (the scheduler's own count, in ns: finer than utime's ticks)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_by_hop(brokers: dict[int, list[int]]) -> dict[str, float]:
    """Seconds run so far by the brokers' loop threads and by their metadata services, of the servers in
    `brokers` (server -> its broker's processes)."""
    out = {"broker loop": 0.0, "metadata service": 0.0}
    for pids in brokers.values():
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    meta = b"metadata_service" in f.read()
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")] if meta else [pid]
            except OSError:
                continue
            out["metadata service" if meta else "broker loop"] += sum(_on_cpu(pid, t) for t in tids)
    return out


PARTS = ("broker loop", "broker engine", "metadata service", "importer engines")


def cpu_by_part(brokers: dict[int, list[int]], workers: set[int]) -> dict[str, float]:
    """CPU seconds so far of each part of every server: the broker's loop thread (its main thread), the broker's
    other threads (its transfer engine's), its metadata service child, and the importing processes' threads but
    their main one (their engines', which run while the imports are held)."""
    out = dict.fromkeys(PARTS, 0.0)
    for pids in brokers.values():
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            if b"metadata_service" in cmdline:
                out["metadata service"] += cpu_seconds(pid)
                continue
            for tid in tids:
                out["broker loop" if tid == pid else "broker engine"] += cpu_seconds(pid, tid)
    for pid in workers:
        with contextlib.suppress(OSError):
            for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
                if tid != pid:
                    out["importer engines"] += cpu_seconds(pid, tid)
    return out


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KiB
    return 0


def broker_pids(cluster: Any, n: int, workers: set[int]) -> list[int]:
    """The broker's processes on server `n` (the broker and its metadata service): every process there but the
    workers (and the `ip netns exec` wrappers, which exec and are the workers themselves)."""
    return [p for p in cluster.pids(n) if p not in workers]


def started(pid: int) -> tuple[int, int]:
    """(pid, start time in clock ticks since boot): a process, told apart from a later one reusing its pid; the
    start time is -1 for a process that is gone or has exited (a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return pid, int(fields[19]) if fields[0] != "Z" else -1
    except (OSError, ValueError, IndexError):
        return pid, -1


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _in_use(paths: set[str]) -> set[str]:
    """Which of `paths` a live process has open or mapped (another program's, not a leftover)."""
    used: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target in paths:
                        used.add(target)
            with open(f"/proc/{pid}/maps") as maps:
                used.update(path for line in maps if (path := line.rstrip("\n").split(maxsplit=5)[-1]) in paths)
    return used


def left_behind(cluster: Any, ran: set[tuple[int, int]], shm_before: set[str]) -> list[str]:
    """What `cluster down` left: its namespaces, any process that ran on its servers (brokers, their metadata
    services, the workers, whose threads are the engines), and /dev/shm entries made during the run that no live
    process holds."""
    from .cluster import _namespaces

    left = sorted(f"namespace {ns}" for ns in _namespaces() if ns.startswith(f"vmms-{cluster.name}-"))
    left += sorted(f"process {pid}" for pid, start in ran if start >= 0 and started(pid) == (pid, start))
    fresh = {f"/dev/shm/{name}" for name in shm_entries() - shm_before}
    unused = fresh - _in_use(fresh)
    # a second look after the scan of every process: another program's entry made and removed meanwhile is gone
    left += sorted(f"file {path}" for path in unused if os.path.lexists(path))
    return left

