"""The transfer engine (Mooncake Transfer Engine, `vmmshare[fabric]`): the only module that imports it.

An engine serves the memory registered with it to any peer that names its segment (``"<address>:<rpc port>"``)
and moves bytes one-sided to and from other engines' registered memory. Facts it is built around:
- its settings are read once, when the module is imported: MC_LOG_LEVEL, the no-progress timeout (from
  VMMSHARE_FABRIC_TIMEOUT) and a whole-call deadline set far out, so that only a stall fails a transfer;
- it listens on two ports on every interface whatever address it is given, and its listening sockets are not
  close-on-exec (they are made so here, after `initialize`);
- a transfer fails with -1 and nothing more (the reason only in the engine's own log, which is silenced here
  unless MC_LOG_LEVEL is set); an address outside the peer's registered memory costs the connection, so callers
  check bounds first;
- the first contact with a frozen peer blocks for 60 s whatever the settings: it runs here on a helper thread
  that the caller waits for at most the fabric timeout;
- after a peer went away, each new transfer to it spends most of a second reconnecting before it fails: a segment
  whose transfer failed is probed first with a plain TCP connect to where it takes transfers, and a refused or
  unanswered probe fails the copy at once (a peer that answers the probe gets the engine's transfer again).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import math
import os
import socket
import threading
from types import ModuleType
from typing import Any

from ..errors import FeatureNotSupportedError, InternalError, IpcError

log = logging.getLogger("vmmshare.fabric")
INSTALL_HINT = ("pip install 'vmmshare[fabric]' and the system libraries it loads "
                "(apt-get install libibverbs1 libnuma1 libcurl4)")
CHUNK = 64 << 20  # bytes per engine call: a long copy is many calls, each well inside the engine's deadlines
CALL_DEADLINE_S = 3600  # MC_TRANSFER_TIMEOUT: the whole-call deadline, far out (stalls are the progress timeout's)

_module: ModuleType | None = None
_load_lock = threading.Lock()


def load(timeout: float) -> ModuleType:
    """The engine's module, imported once with this process's settings; 207000 with what to install if missing."""
    global _module
    with _load_lock:
        if _module is not None:
            return _module
        chosen = "MC_LOG_LEVEL" in os.environ  # a user who sets it wants the engine's own lines, on stderr
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        if os.environ.pop("MC_LOG_DIR", None) is not None:  # the engine aborts the process on import with it set
            log.warning("MC_LOG_DIR is not supported by the transfer engine's logging here: ignored")
        os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(max(1, math.ceil(timeout)))
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(CALL_DEADLINE_S))
        try:
            import mooncake.engine as module
        except (ImportError, OSError) as exc:
            raise FeatureNotSupportedError(
                f"the cross-server transport needs the transfer engine, which cannot be loaded ({exc}): {INSTALL_HINT}"
            ) from None
        if not chosen:
            _silence_engine_log()
        _module = module
        return _module


def missing() -> str:
    """Why the engine cannot be loaded in this process ("" when it can), without loading it."""
    import importlib.util

    try:
        if importlib.util.find_spec("mooncake") is None:
            return f"the transfer engine is not installed: {INSTALL_HINT}"
    except (ImportError, ValueError) as exc:
        return f"the transfer engine cannot be found: {exc}"
    return ""


class Engine:
    """One initialised engine: the segment peers name it by, memory registration, and one-sided transfers."""

    def __init__(self, address: str, protocol: str = "tcp", timeout: float = 5.0,
                 metadata: str = "P2PHANDSHAKE") -> None:
        """`metadata`: the node's metadata service URL (this node's engines are all started with one, see
        metadata.py), or P2PHANDSHAKE, where the engine serves its descriptor to any peer that asks."""
        module = load(timeout)
        self.address, self.protocol, self.timeout, self.metadata = address, protocol, timeout, metadata
        before = set(_socket_fds())
        self._engine: Any = module.TransferEngine()
        rc = self._engine.initialize(address, metadata, protocol, "")
        if rc != 0:
            raise IpcError(f"the transfer engine would not start on {address} over {protocol} (code {rc}); run "
                           "with MC_LOG_LEVEL=ERROR to see its own reason")
        self.listening = _close_on_exec_listeners(before)  # (address, port) of its listening sockets
        host = f"[{address}]" if ":" in address else address
        # the name peers know it by: its address and RPC port (P2PHANDSHAKE), or its name in the metadata service
        self.segment = f"{host}:{self._engine.get_rpc_port()}" if metadata == "P2PHANDSHAKE" else address
        self._contacted: set[str] = set()
        self._failing: dict[str, tuple[str, int] | None] = {}  # segment -> where it takes transfers, once one failed
        self._first_contact: dict[str, threading.Thread] = {}
        self._scratch = ctypes.create_string_buffer(1)  # a first contact's one byte lands here, never freed
        self._lock = threading.Lock()

    # ------------------------------------------------------------ serving memory

    def register(self, address: int, size: int) -> None:
        rc = self._engine.register_memory(address, size)
        if rc != 0:
            raise InternalError(f"the transfer engine refused to serve {size} bytes at {address:#x} (code {rc})")

    def unregister(self, address: int) -> None:
        rc = self._engine.unregister_memory(address)
        if rc != 0:
            log.warning("the transfer engine did not serve %#x any more (code %d)", address, rc)

    # ------------------------------------------------------------ moving bytes

    def read(self, segment: str, local: int, remote: int, size: int) -> None:
        """Copy `size` bytes at `remote` of the peer's registered memory to this process's `local`."""
        self._move(segment, local, remote, size, write=False)

    def write(self, segment: str, local: int, remote: int, size: int) -> None:
        """Copy `size` bytes at this process's `local` to `remote` of the peer's registered memory."""
        self._move(segment, local, remote, size, write=True)

    def _move(self, segment: str, local: int, remote: int, size: int, write: bool) -> None:
        if segment in self._failing:
            self._probe(segment, "write" if write else "read", size)
        if segment not in self._contacted:
            self._contact(segment, remote)
        call = self._engine.transfer_sync_write if write else self._engine.transfer_sync_read
        if size <= CHUNK:  # the common case, one call
            if call(segment, local, remote, size) != 0:
                self._failed(segment, "write" if write else "read", size)
            return
        done = 0
        while done < size:
            n = min(CHUNK, size - done)
            if call(segment, local + done, remote + done, n) != 0:
                self._failed(segment, "write" if write else "read", size)
            done += n

    def _contact(self, segment: str, remote: int) -> None:
        """The first transfer to `segment` makes the engine's handshake, which waits 60 s on a frozen peer: make it
        with a one-byte read on a helper thread, and wait for it at most the fabric timeout."""
        with self._lock:
            thread = self._first_contact.get(segment)
            if thread is None or not thread.is_alive():
                outcome: list[int] = []
                thread = threading.Thread(
                    target=lambda: outcome.append(self._engine.transfer_sync_read(
                        segment, ctypes.addressof(self._scratch), remote, 1)),
                    name="vmmshare-fabric-contact", daemon=True)
                thread.outcome = outcome  # type: ignore[attr-defined]
                self._first_contact[segment] = thread
                thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise IpcError(f"the node serving {segment} did not answer the transfer engine within {self.timeout:g} s "
                           "(VMMSHARE_FABRIC_TIMEOUT): it is frozen, overloaded or unreachable")
        if thread.outcome != [0]:  # type: ignore[attr-defined]
            with self._lock:
                self._first_contact.pop(segment, None)
            self._failed(segment, "reach", 0)
        with self._lock:
            self._contacted.add(segment)
            self._first_contact.pop(segment, None)

    def _probe(self, segment: str, what: str, size: int) -> None:
        """A segment whose last transfer failed: a TCP connect to where it takes transfers, within the fabric
        timeout; refused or unanswered, the transfer fails now (not after the engine's second of reconnecting)."""
        where = self._failing.get(segment)
        if where is None:
            return  # nowhere known to probe: the engine tries
        try:
            with socket.create_connection(where, timeout=self.timeout):
                pass
        except OSError:
            self._failed(segment, what, size)
        with self._lock:
            self._failing.pop(segment, None)

    def _failed(self, segment: str, what: str, size: int) -> None:
        where = self._failing[segment] if segment in self._failing else self._data_address(segment)
        with self._lock:
            self._contacted.discard(segment)  # a peer that went away may come back under the same name
            self._failing[segment] = where
        amount = f" {size} bytes of" if size else ""
        at = segment
        if where is not None and self.metadata != "P2PHANDSHAKE":
            at = f"{where[0]}:{where[1]} (segment {segment})"
        raise IpcError(f"the transfer engine could not {what}{amount} the memory served at {at}: "
                       "that node's broker is down or unreachable, or no longer serves the memory")

    def _data_address(self, segment: str) -> tuple[str, int] | None:
        """Where `segment`'s engine takes transfers (address, port): the segment's own name (P2PHANDSHAKE), or as
        this node's metadata service describes it to this process; None if neither says."""
        if self.metadata == "P2PHANDSHAKE":
            host, _, port = segment.rpartition(":")
            return (host.strip("[]"), int(port)) if port.isdigit() else None
        import json
        import urllib.parse
        import urllib.request

        url = f"{self.metadata}?key={urllib.parse.quote('mooncake/ram/' + segment, safe='')}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as reply:
                desc = json.loads(reply.read())
            host, port = desc["tcp_data_host"], desc["tcp_data_port"]
            if not isinstance(host, str) or not isinstance(port, int):
                return None
            return host, port
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def close(self) -> None:
        """Stop the engine (its threads and ports go)."""
        engine, self._engine = self._engine, None
        del engine


GLOG_FATAL = 3  # glog's severities: 0 INFO, 1 WARNING, 2 ERROR (MC_LOG_LEVEL's highest), 3 FATAL


def _silence_engine_log() -> None:
    """Raise the engine's own log threshold (glog's FLAGS_minloglevel, which MC_LOG_LEVEL sets) to FATAL: its
    lines ("Logging before InitGoogleLogging()", "Local segment descriptor not found", a refused TCP lane) are
    not the user's to act on, and vmmshare reports each failure they accompany in its own words. Nothing else
    is touched: fd 2 stays this process's, for every thread. With MC_LOG_LEVEL set by the user, load() leaves
    the engine's logging as the user chose."""
    path = _loaded_library("libglog")
    try:
        if path is None:
            raise OSError("the engine's logging library is not loaded")
        glog = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        ctypes.c_int.in_dll(glog, "_ZN3fLI17FLAGS_minloglevelE").value = GLOG_FATAL
    except (OSError, ValueError) as exc:  # another build of the engine: its lines then reach stderr
        log.debug("cannot set the transfer engine's log level (%s): its own messages will show", exc)


def _loaded_library(stem: str) -> str | None:
    """The path of the loaded shared library whose file name starts with `stem` (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


# ---------------------------------------------------------------- one engine per process


_shared: tuple[int, Engine] | None = None
_shared_lock = threading.Lock()


def process_engine(address: str, protocol: str, timeout: float, metadata: str = "P2PHANDSHAKE") -> Engine:
    """This process's engine for moving bytes, made on first use with the metadata URL its broker gave it; a forked
    child makes its own, and a new URL (its broker restarted) a new one."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid() or _shared[1].metadata != metadata:
            _shared = (os.getpid(), Engine(address, protocol, timeout, metadata))
        return _shared[1]


# ---------------------------------------------------------------- the engine's sockets


def _socket_fds() -> dict[int, int]:
    """fd -> socket inode for every socket this process holds."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                out[int(name)] = int(target[8:-1])
    return out


def listening_sockets() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket of this network namespace."""
    out: dict[int, tuple[str, int]] = {}
    for table, width in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                cols = line.split()
                if len(cols) < 10 or cols[3] != "0A":  # 0A: LISTEN
                    continue
                host, port = cols[1].split(":")
                out[int(cols[9])] = (_address(host, width), int(port, 16))
    return out


def _address(hex_text: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host order
    return str(ipaddress.IPv4Address(words) if width == 4 else ipaddress.IPv6Address(words))


def _close_on_exec_listeners(before: set[int]) -> list[tuple[str, int]]:
    """Mark the listening sockets that appeared since `before` close-on-exec; their (address, port)."""
    listeners = listening_sockets()
    found = []
    for fd, inode in _socket_fds().items():
        if fd in before or inode not in listeners:
            continue
        with contextlib.suppress(OSError):
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
        found.append(listeners[inode])
    return sorted(set(found))
