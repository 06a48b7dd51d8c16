"""vmmshare demo --fabric: memory shared across two servers, one-sided, with the rules checked on the way.

Two servers are made for the run as network namespaces of this machine (`vmmshare cluster`), each with its own
broker (started by the library), server id and fabric address, one cluster key for both. On server 1 a process
allocates memory, writes a message in it and exports it as a FABRIC handle trusting one process of server 2 by its
bare tgid; the 128 bytes travel by value (a pipe here). That process imports the handle on server 2, maps it,
reads the message with memcpy and writes an answer back, one-sided; an untrusted process of server 2 is refused.
Needs root (network namespaces) and the engine (pip install 'vmmshare[fabric]').
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

EXPORTER = r"""
import ctypes, sys
import vmmshare.acl as acl
P = {"handleType": 0, "allocationType": 0, "memAttr": 5, "location": {"id": 0, "type": 1}, "reserve": 0}
acl.rt.set_device(0)
trusted = int(sys.stdin.readline())
h, _ = acl.rt.malloc_physical(2 << 20, P, 0)
p, _ = acl.rt.reserve_mem_address(2 << 20, 0, 0, 0)
acl.rt.map_mem(p, 2 << 20, 0, h, 0)
ctypes.memmove(p, b"hello from server 1", 19)
s, ret = acl.rt.mem_export_to_shareable_handle_v2(h, 0, acl.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC)
assert ret == 0, acl.get_recent_err_msg()
assert acl.rt.mem_set_pid_to_shareable_handle_v2(s, acl.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC, [trusted]) == 0
print(s.hex(), flush=True)
sys.stdin.readline()   # the importer is done
print(ctypes.string_at(p + 4096, 24).rstrip(b"\0").decode(), flush=True)
"""

IMPORTER = r"""
import ctypes, sys
import vmmshare.acl as acl
FABRIC = acl.ACL_MEM_SHARE_HANDLE_TYPE_FABRIC
acl.rt.set_device(0)
pid, _ = acl.rt.device_get_bare_tgid()
print(pid, flush=True)
s = bytes.fromhex(sys.stdin.readline().strip())
h, ret = acl.rt.mem_import_from_shareable_handle_v2(s, FABRIC, 0)
assert ret == 0, acl.get_recent_err_msg()
p, _ = acl.rt.reserve_mem_address(2 << 20, 0, 0, 0)
assert acl.rt.map_mem(p, 2 << 20, 0, h, 0) == 0, acl.get_recent_err_msg()
buf, _ = acl.rt.malloc_host(4096)
assert acl.rt.memcpy(buf, 4096, p, 19, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0, acl.get_recent_err_msg()
print(ctypes.string_at(buf, 19).decode(), flush=True)
ctypes.memmove(buf, b"and back from server 2", 22)
assert acl.rt.memcpy(p + 4096, 4096, buf, 22, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0, acl.get_recent_err_msg()
acl.rt.unmap_mem(p); acl.rt.release_mem_address(p); acl.rt.free_physical(h); acl.rt.free_host(buf)
"""

OUTSIDER = r"""
import sys
import vmmshare.acl as acl
acl.rt.set_device(0)
h, ret = acl.rt.mem_import_from_shareable_handle_v2(bytes.fromhex(sys.argv[1]), 2, 0)
print(ret, acl.get_recent_err_msg(), flush=True)
"""


def main(argv: list[str]) -> int:
    from ..fabric.engine import missing
    from .cluster import Cluster, ClusterError
    from .console import FAILED, OK, USAGE, Parser, say_error

    Parser(prog="vmmshare demo --fabric", description=(__doc__ or "").split("\n\n")[0]).parse_args(argv)
    prog = "vmmshare demo --fabric"
    if os.geteuid() != 0:
        say_error(prog, "needs root: it makes two servers as network namespaces for the run")
        return USAGE
    if missing():
        say_error(prog, missing())
        return USAGE
    root = Path(tempfile.mkdtemp(prefix="vmmshare-demo-"))
    cluster = Cluster(f"d{os.getpid() % 10000}", 2, root=root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMMSHARE_")}
    started: list[subprocess.Popen[str]] = []

    def start(argv: list[str], stdin: int | None = None, stderr: int | None = None) -> subprocess.Popen[str]:
        """A process of the demo (its stdout a pipe), in a session of its own: out of reach of the terminal's Ctrl-C,
        which would print a traceback from it; this process alone gets it, and stops the ones it started."""
        started.append(subprocess.Popen(argv, env=env, text=True, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr,
                                        start_new_session=True))
        return started[-1]

    try:
        cluster.up()
        one, two = cluster.server(1), cluster.server(2)
        print(f"server 1: {one.address} (id {one.server_id:#x}), server 2: {two.address} (id {two.server_id:#x}), "
              "joined by a private bridge; one cluster key")
        py = sys.executable
        imp = start(two.command([py, "-c", IMPORTER]), stdin=subprocess.PIPE)
        exp = start(one.command([py, "-c", EXPORTER]), stdin=subprocess.PIPE)
        assert imp.stdin and imp.stdout and exp.stdin and exp.stdout
        tgid = imp.stdout.readline().strip()
        print(f"server 2: an importer, bare tgid {tgid}")
        exp.stdin.write(f"{tgid}\n")
        exp.stdin.flush()
        handle = exp.stdout.readline().strip()
        if not handle:
            raise ClusterError("the exporter failed (its error is above)")
        print(f"server 1: exported 2 MiB as a FABRIC handle, trustlist [{tgid}]: {handle[:48]}...")
        outsider = start(two.command([py, "-c", OUTSIDER, handle]), stderr=subprocess.PIPE)
        said = outsider.communicate()[0]
        print(f"server 2: an untrusted process imports it: {said.strip()[:160]}")
        imp.stdin.write(handle + "\n")
        imp.stdin.close()
        read = imp.stdout.readline().strip()
        print(f"server 2: the importer imported, mapped and read with memcpy: {read!r}")
        if imp.wait(120) != 0:
            raise ClusterError("the importer failed (its error is above)")
        exp.stdin.write("done\n")
        exp.stdin.close()
        answer = exp.stdout.readline().strip()
        exp.wait(60)
        print(f"server 1: its own memory now holds what server 2 wrote, one-sided: {answer!r}")
        ok = read == "hello from server 1" and answer == "and back from server 2" and said.startswith("207006")
        print("every step behaved" if ok else "a step misbehaved")
        return OK if ok else FAILED
    except ClusterError as exc:
        say_error(prog, str(exc))
        return FAILED
    finally:
        for proc in started:  # left running by a failure or a Ctrl-C
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        cluster.down()
