"""A second process driven over stdin/stdout: each line is a JSON call into ``vmmshare.acl``, answered by JSON.

Run as ``python actor.py``; the test side is `procs.py`. With VMMSHARE_ACTOR_SURFACE=c the calls go to the C
library instead (libascendcl.so through the pyACL-shaped binding of `cacl.py`), so one test drives either surface.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
from typing import Any

import vmmshare.acl as acl


def encode(value: Any) -> Any:
    """JSON-ready: bytes as {"__bytes__": hex}, tuples as lists."""
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": bytes(value).hex()}
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


def decode(value: Any, seq: Any = list) -> Any:
    """The inverse of `encode`; JSON arrays become `seq` (the test side reads results as tuples)."""
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return bytes.fromhex(value["__bytes__"])
        return {k: decode(v, seq) for k, v in value.items()}
    if isinstance(value, list):
        return seq(decode(v, seq) for v in value)
    return value


def _special(name: str, args: list[Any]) -> Any:
    if name == "pid":
        return os.getpid()
    if name == "write":  # ptr, byte value, size
        ctypes.memset(args[0], args[1], args[2])
        return None
    if name == "write_bytes":
        ctypes.memmove(args[0], args[1], len(args[1]))
        return None
    if name == "read":
        return ctypes.string_at(args[0], args[1])
    if name == "sha256":
        return hashlib.sha256(ctypes.string_at(args[0], args[1])).hexdigest()
    if name == "fd_count":
        return len(os.listdir("/proc/self/fd"))
    if name == "remote":  # where another server serves an imported handle's memory: [segment, address, size]
        from vmmshare._process import runtime

        mem: Any = runtime().memory.allocation(args[0]).mem
        return [mem.segment, mem.address, mem.size]
    if name == "allow_server":  # trust pids of one other server on an export: shareable, server id, pids
        from vmmshare._process import runtime
        from vmmshare.wire.handles import ShareableHandle

        runtime().sharing.set_remote_pids(ShareableHandle.from_value(args[0]), args[1], args[2])
        return None
    if name == "threads_import":  # shareable, share type, n: n threads import it at once; their handles
        import threading

        start = threading.Barrier(args[2])
        got: list[Any] = [None] * args[2]

        api = surface()

        def one(k: int) -> None:
            api.rt.set_device(0)
            start.wait()
            got[k] = api.rt.mem_import_from_shareable_handle_v2(args[0], args[1], 0)[0]

        threads = [threading.Thread(target=one, args=(k,)) for k in range(args[2])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got
    if name == "exit":
        sys.stdout.flush()
        os._exit(int(args[0]) if args else 0)
    raise ValueError(f"unknown special call {name}")


def surface() -> Any:
    """The calls' surface: vmmshare.acl, or the C library (VMMSHARE_ACTOR_SURFACE=c)."""
    if os.environ.get("VMMSHARE_ACTOR_SURFACE", "python") == "c":
        import cacl

        return cacl.load()
    return acl


def main() -> None:
    api = surface()
    for line in sys.stdin:
        req = json.loads(line)
        name, args = req["call"], decode(req.get("args", []))
        try:
            if name.startswith("!"):
                result = _special(name[1:], args)
            else:
                fn: Any = api
                for part in name.split("."):
                    fn = getattr(fn, part)
                result = fn(*args)
            out = {"ok": encode(result), "err": api.get_recent_err_msg()}
        except Exception as exc:  # report, keep serving
            out = {"exc": repr(exc)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the run that drives this actor reports it
        sys.exit(130)
