"""``vmmshare doctor``: what this machine offers the runtime, what each slower path costs, and the fix."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import config as cfg
from ..backends import host, mman
from ..broker.system import answers
from ..sockets.packets import peer_credentials, peer_pidfd
from .console import wrap_line


@dataclass
class Finding:
    """One line of the report. `status`: "ok"; "slow" (works, with a cost); "limit" (works, up to a capacity limit);
    "missing" (does not work until fixed)."""

    status: str
    item: str
    detail: str
    fix: str = ""


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def huge_pages() -> list[Finding]:
    out = []
    for size, name, attr in ((2 << 20, "2 MiB", "*_HUGE"), (1 << 30, "1 GiB", "*_HUGE1G")):
        base = f"/sys/kernel/mm/hugepages/hugepages-{size // 1024}kB"
        total = _read(f"{base}/nr_hugepages")
        free = host.hugetlb_free_bytes(size) // size
        if total and int(total) > 0:
            detail = f"{total} pages, {free} free: {attr} allocations use them"
            out.append(Finding("ok", f"hugetlb {name} pool", detail))
        else:
            count = 512 if size == 2 << 20 else 4
            out.append(Finding(
                "slow", f"hugetlb {name} pool",
                f"empty: {attr} allocations fall back to transparent or normal pages (more TLB misses, "
                "slower first touch)",
                f"echo {count} | sudo tee {base}/nr_hugepages",
            ))
    mode = host.shmem_thp_mode()
    if mode in ("always", "within_size", "advise", "force"):
        out.append(Finding("ok", "THP for shared memory", f"shmem_enabled={mode}: huge attrs get THP as a fallback"))
    else:
        out.append(Finding(
            "slow", "THP for shared memory", f"shmem_enabled={mode}: with no hugetlb pool, huge attrs get 4 KiB pages",
            "echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled",
        ))
    return out


def kernel_features() -> list[Finding]:
    out = []
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        fd = peer_pidfd(a)
        if fd >= 0:
            os.close(fd)
            out.append(Finding("ok", "pidfd peer identity", "SO_PEERPIDFD: the broker pins each client's identity"))
        else:
            out.append(Finding("slow", "pidfd peer identity",
                               "SO_PEERPIDFD missing (Linux < 6.5): identity from SO_PEERCRED and start time only",
                               "upgrade to Linux 6.5 or later"))
    finally:
        a.close()
        b.close()
    try:
        arena = mman.Arena()
        ptr = arena.reserve(2 << 20, 2 << 20)
        arena.release(ptr, 2 << 20)
        in_arena = mman.ARENA_START <= ptr < mman.ARENA_END
        out.append(Finding("ok" if in_arena else "slow", "reservation arena",
                           f"16-24 TiB arena {'usable' if in_arena else 'occupied: reservations land elsewhere'}"))
    except OSError as exc:
        out.append(Finding("missing", "reservation arena", f"cannot reserve address space: {exc}"))
    addr = mman.map_anonymous(4096)
    ok = mman.populate(addr, 4096)
    mman.unmap(addr, 4096)
    out.append(Finding("ok" if ok else "slow", "pre-populated mappings",
                       "MADV_POPULATE_READ available" if ok else "MADV_POPULATE_READ missing (Linux < 5.14): "
                       "pre-populate falls back to first touch", "" if ok else "upgrade to Linux 5.14 or later"))
    ns = _read("/proc/sys/user/max_user_namespaces")
    pid_ns_ok = os.geteuid() == 0 or (ns.isdigit() and int(ns) > 0)
    out.append(Finding("ok" if pid_ns_ok else "missing", "pid namespaces",
                       "processes in their own pid namespace import by host pid (device_get_bare_tgid)"
                       if pid_ns_ok else "user namespaces disabled: unshare --pid needs root here",
                       "" if pid_ns_ok else "sudo sysctl user.max_user_namespaces=15000"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    status = "ok" if hard >= 65536 else "limit"
    out.append(Finding(status, "open-file limit",
                       f"soft {soft}, hard {hard}: the broker holds one fd per export, so at most about {hard} exports",
                       "" if status == "ok" else "raise the hard limit (ulimit -Hn / LimitNOFILE=) to 65536 or more"))
    return out


def configuration() -> list[Finding]:
    """Each VMMSHARE_* variable that cannot be used: a finding of its own, not a failure of the report."""
    return [Finding("missing", exc.name, str(exc), _fix_for(exc.name)) for exc in cfg.problems()]


def _fix_for(name: str) -> str:
    """The fix for a variable that cannot be used: a missing one is set, a bad one unset or corrected."""
    if name not in os.environ:  # another setting needs this one (VMMSHARE_FABRIC=tcp needs VMMSHARE_FABRIC_ADDR)
        return f"set {name} (see docs/configuration.md)"
    return f"unset {name}, or give it a value from docs/configuration.md"


def broker(path: Path) -> list[Finding]:
    out = []
    folder = path.parent
    if not folder.exists():
        return [Finding("ok", "broker socket", f"{path}: no broker yet; the first client starts one")]
    mode = stat.S_IMODE(folder.stat().st_mode)
    out.append(Finding("ok" if mode in (0o700, 0o755) else "missing", "socket folder", f"{folder} mode {mode:o}",
                       "" if mode in (0o700, 0o755) else f"chmod 700 {folder}"))
    if path.exists():
        smode = stat.S_IMODE(path.stat().st_mode)
        there = answers(path)
        out.append(Finding("ok" if there else "slow", "broker socket",
                           f"{path} mode {smode:o}, {'a broker answers' if there else 'stale: nobody answers'}",
                           "" if there else "nothing to do: the next client replaces it"))
    else:
        out.append(Finding("ok", "broker socket", f"{path}: no broker running; the first client starts one"))
    return out


def backend(name: str) -> list[Finding]:
    if name == "host":
        return [Finding("ok", "backend", "host: device memory is host shared memory (memfd)")]
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        if name == "auto":
            return [Finding("ok", "backend", "auto: cuda-bindings is not installed, device memory is host memory")]
        return [Finding("missing", "backend", f"VMMSHARE_BACKEND={name} but cuda-bindings is not installed",
                        "pip install 'vmmshare[cuda]'")]
    from ..backends.cuda import CudaBackend
    from ..errors import AclError

    try:
        gpu = CudaBackend()
        gpus = ", ".join(f"GPU {d}: {gpu.total_memory(d) >> 20} MiB, granularity {gpu.granularity(d) >> 10} KiB"
                         for d in range(gpu.count))
    except AclError as exc:
        if name == "auto":
            return [Finding("ok", "backend", f"auto: no usable GPU ({exc.message}), device memory is host memory")]
        return [Finding("missing", "backend", f"VMMSHARE_BACKEND=cuda but no usable GPU: {exc.message}",
                        "install the NVIDIA driver, or use VMMSHARE_BACKEND=host")]
    return [Finding("ok", "backend", f"{name}: device memory is GPU memory ({gpus})")]


def fabric() -> list[Finding]:
    """The cross-server transport: its settings, the engine, the key file, and what the engine exposes."""
    try:
        mode = cfg.fabric()
    except cfg.ConfigError:
        return []  # reported with the configuration
    if mode == "off":
        return [Finding("ok", "fabric", "off: FABRIC handles import on this server only (VMMSHARE_FABRIC=tcp and "
                        "docs/fabric.md to share across servers)")]
    from ..fabric.agent import FabricSetupError, read_cluster_key
    from ..fabric.engine import missing

    out = []
    problem = missing()
    out.append(Finding("missing" if problem else "ok", "fabric engine", problem or "the transfer engine is installed",
                       "pip install 'vmmshare[fabric]'; apt-get install libibverbs1 libnuma1 libcurl4" if problem
                       else ""))
    try:
        read_cluster_key(cfg.cluster_key_file())
        out.append(Finding("ok", "cluster key", f"{cfg.cluster_key_file()}: readable by this user only"))
    except (FabricSetupError, cfg.ConfigError) as exc:
        out.append(Finding("missing", "cluster key", str(exc), "see docs/fabric.md: one key file for the cluster"))
    out += _engine_exposure()
    return out


def _engine_exposure() -> list[Finding]:
    """The engine listens on every interface whatever address it is given: say where its ports are reachable."""
    from ..fabric.engine import listening_sockets

    try:
        addr, path = cfg.fabric_addr(), cfg.socket_path()
    except cfg.ConfigError:
        return []
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(str(path))
        pid = peer_credentials(s)[0]
    except OSError:
        return [Finding("ok", "fabric exposure", "no broker runs: nothing listens yet")]
    finally:
        s.close()
    listeners = listening_sockets()
    ports = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and int(target[8:-1]) in listeners:
                    ports.add(listeners[int(target[8:-1])])
    wild = sorted(p for a, p in ports if a in ("0.0.0.0", "::"))
    others = [a for a in _local_addresses() if a != addr and not a.startswith("127.") and a != "::1"]
    if not wild or not others:
        return [Finding("ok", "fabric exposure", f"the broker's ports are reachable on {addr or 'this node'} only")]
    return [Finding("limit", "fabric exposure",
                    f"the transfer engine listens on every interface (ports {', '.join(map(str, wild))}): besides "
                    f"{addr} it is reachable on {', '.join(others)}; it has no authentication of its own",
                    "firewall those ports to the fabric network, or run the broker in a network namespace whose "
                    "only interface is on it (docs/security.md)")]


def _local_addresses() -> list[str]:
    try:
        # a hang guard only
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]


def run(as_json: bool = False) -> int:
    """Print the findings (a table, or JSON); 1 if anything is missing, a bad VMMSHARE_* variable included."""
    findings = huge_pages() + kernel_features() + configuration()
    try:
        findings += broker(cfg.socket_path())
    except cfg.ConfigError as exc:
        findings.append(Finding("missing", "broker socket", f"unknown: {exc.name} cannot be used", f"fix {exc.name}"))
    findings += fabric()
    try:
        findings += backend(cfg.backend())
    except cfg.ConfigError as exc:
        findings.append(Finding("missing", "backend", f"unknown: {exc.name} cannot be used", f"fix {exc.name}"))
    if as_json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:  # each line at most WIDTH columns: the detail and the fix wrap under themselves
            print("\n".join(wrap_line(f"{f.status:8s} {f.item:24s} {f.detail}", hang=34)))
            if f.fix:
                print("\n".join(wrap_line(f"{'':33s}fix: {f.fix}", hang=38)))
    return 1 if any(f.status == "missing" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(run("--json" in sys.argv))
