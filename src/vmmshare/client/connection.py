"""The broker client: the runtime's `Node` on a real node, a session with the broker over its socket.

It reaches the broker through autostart.py (which starts one when none answers), and reconnects by itself when
the broker restarts, charging its live allocations again. Two kinds of id meet here: a *token* is the runtime's
name for an allocation or import (what `charge` and `import_handle` return, stable for the process's life); a
*hold* is the broker's id for this connection's claim on it, which a restarted broker gives out anew.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import struct
import threading
from _thread import get_ident
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..backends.remote import Transfers
from ..config import Config
from ..errors import AclError, IpcError, error_from_code
from ..runtime.node import Imported, RemoteImported
from ..sockets import packets
from ..sockets.packets import DONTWAIT, close_fds
from ..wire import local as P
from ..wire.local import ProtocolError, decode, encode
from ..wire.props import PhysicalProp, prop_of
from .autostart import reach_broker

log = logging.getLogger("vmmshare.client")
REPLY_TIMEOUT = 60.0
RETRIES = 4  # a dying broker's listener can still take a connection or two before it is gone
R = TypeVar("R", bound=P.Message)
T = TypeVar("T")
Args = ParamSpec("Args")
IMPORT, IMPORTED, RELEASE, OK = P.HOT_IMPORT, P.HOT_IMPORTED, P.HOT_RELEASE, P.HOT_OK


class BrokerClient:
    """One connection per process to the node's broker; thread-safe, one request at a time."""

    def __init__(self, config: Config, autostart: bool = True) -> None:
        self.config = config
        self.path = config.socket_path
        self.autostart = autostart
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._req = itertools.count(1)  # request ids
        self._tokens = itertools.count(1)
        self._holds: dict[int, int] = {}  # token -> the broker's hold id on this connection
        self._charges: dict[int, P.Charge | P.ChargeGpu] = {}  # token -> its charge, to repeat on a new broker
        self._waiter = _Waiter(config.spin)
        packets.use_pure(config.pure_python)
        self._owner: int | None = None  # the thread in a request, if any
        self._metadata = "P2PHANDSHAKE"  # this process's metadata URL, from its first remote import's reply

    # ------------------------------------------------------------ connection

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _reconnect(self) -> socket.socket:
        """Connect (again); after a broker restart, charge every live allocation of ours anew.

        If the connection dies while re-charging, the next attempt starts over from all of them.
        """
        self._reset()
        self._holds.clear()  # hold ids of a broker that is gone
        sock = reach_broker(self.path, self.autostart)
        self._sock = sock
        for token, charge in list(self._charges.items()):
            try:
                reply, _ = self._exchange(sock, charge, P.Token, (), None)
            except AclError as exc:  # e.g. the new broker has less capacity: keep serving, uncharged
                log.warning("could not charge an allocation to the restarted broker: %s", exc)
                continue
            self._holds[token] = reply.hold
        return sock

    def close(self) -> None:
        with self._lock:
            self._reset()

    def after_fork(self) -> None:
        """In a forked child: the parent's connection and holds are not ours."""
        self._lock = threading.Lock()
        self._reset()
        self._holds.clear()
        self._charges.clear()

    def _send_and_wait(
        self, sock: socket.socket, frame: bytes, fds: tuple[int, ...], meanwhile: Callable[[], None] | None,
    ) -> tuple[bytes, list[int], bool]:
        """Send one request frame and take the packet that answers it; `meanwhile` runs while the broker works."""
        if not fds and meanwhile is None:  # most requests: sent and answered in one call
            try:
                packet, got, truncated = self._waiter.call(sock, frame)
            except OSError:
                self._raise_refusal(sock)
                raise
            if not packet and not got:
                raise ConnectionResetError("the broker closed the connection")
            return packet, got, truncated
        try:
            packets.send_packet(sock, frame, fds)
        except OSError:
            self._raise_refusal(sock)
            raise
        if meanwhile is not None:
            meanwhile()  # must not raise: the reply still has to be read
        try:
            packet, got, truncated = self._waiter.wait(sock)
        except OSError:
            self._raise_refusal(sock)
            raise
        if not packet and not got:
            raise ConnectionResetError("the broker closed the connection")
        return packet, got, truncated

    def _raise_refusal(self, sock: socket.socket) -> None:
        """After a send or receive failed: the broker's refusal of this connection, if it said one (it may have closed
        the connection already, and ECONNRESET comes before its word), raised as its error."""
        refusal = _refusal(sock)
        if refusal is not None:
            self._reset()
            raise refusal from None

    def _reply(self, packet: bytes, got: list[int], truncated: bool, req: int, expect: type[R], asked: str) -> R:
        """The reply to request `req` (a request of type `asked`), of type `expect`: a refusal raises its error, and
        anything that does not follow the protocol an IpcError (the connection is dropped then)."""
        try:
            if truncated:
                raise ProtocolError("reply too large")
            got_req, reply = decode(packet, len(got))
            if got_req == 0 and isinstance(reply, P.Error):  # the broker will not serve this connection
                close_fds(got)
                self._reset()
                raise error_from_code(reply.code, reply.message)
            if got_req != req:
                raise ProtocolError(f"reply to request {got_req}, expected {req}")
            if isinstance(reply, P.Error):
                close_fds(got)
                raise error_from_code(reply.code, reply.message)
            if not isinstance(reply, expect):
                raise ProtocolError(f"{reply.TYPE.name} in reply to {asked}")
        except ProtocolError as exc:
            close_fds(got)
            self._reset()
            raise IpcError(f"bad reply from the broker: {exc}") from None
        return reply

    def _exchange(
        self, sock: socket.socket, message: P.Message, expect: type[R], fds: tuple[int, ...],
        meanwhile: Callable[[], None] | None,
    ) -> tuple[R, list[int]]:
        """Send a request and take its reply (of type `expect`); `meanwhile` runs while the broker works on it."""
        req = next(self._req) & 0xFFFFFFFF or next(self._req)  # 0 addresses the broker's refusal of a connection
        packet, got, truncated = self._send_and_wait(sock, encode(message, req), fds, meanwhile)
        return self._reply(packet, got, truncated, req, expect, message.TYPE.name), got

    def _hot_other(
        self, packet: bytes, got: list[int], truncated: bool, req: int, asked: P.Msg, hot: P.HotFrame,
    ) -> tuple[tuple[Any, ...], list[int]]:
        """A reply to a hot request that is not its hot frame: a refusal raises here, and a reply of the hot frame's
        type that the struct did not recognise is read through the full checks (its fields as the struct has them)."""
        layout = P.LAYOUTS[hot.kind]
        reply: P.Message = self._reply(packet, got, truncated, req, layout.message, asked.name)
        return (hot.start, req, hot.length, *layout.values(reply)), got

    def request(
        self, message: P.Message | Callable[[], P.Message], expect: type[R], fds: tuple[int, ...] = (),
        meanwhile: Callable[[], None] | None = None,
    ) -> tuple[R, list[int]]:
        """Send `message` and return the reply, of type `expect`; reconnects if the broker went away.

        A message that names a hold is passed as a function that makes it, called on each attempt: after a
        reconnection the new broker knows the allocation by another hold id.

        `meanwhile` (run once) overlaps local work with the broker's.
        """
        once: Callable[[], None] | None = None
        if meanwhile is not None:
            pending = [meanwhile]

            def once() -> None:  # on whichever attempt gets its request out
                if pending:
                    pending.pop()()

        def attempt(sock: socket.socket) -> tuple[R, list[int]]:
            made = message if isinstance(message, P.Message) else message()
            return self._exchange(sock, made, expect, fds, once)

        return self._locked(attempt)

    def _hot_request(
        self, frame: Callable[[int], bytes], asked: P.Msg, hot: P.HotFrame,
    ) -> tuple[tuple[Any, ...], list[int]]:
        """`request` of a frame that `frame` makes of each attempt's request id, answered by a hot frame
        (wire/local.py's HotFrame): the reply's fields come back as the frame's struct unpacks them (its start, request
        id and length first), with no message object built; any other reply goes through the full checks.

        One function for the frames of every import and free: `_locked`'s loop (its retries are `_failed`'s),
        `_send_and_wait`'s plain branch and the waiter's note of the poll (`_Waiter._after`), written out here:
        calling them costs about 34 more bytecodes a request (a pyACL import and free: 1,135 against 1,067)."""
        with self._lock:
            self._owner = get_ident()
            try:
                for tries in range(RETRIES):
                    try:
                        sock = self._sock or self._reconnect()
                        req = next(self._req) & 0xFFFFFFFF or next(self._req)  # 0 addresses a refusal
                        waiter = self._waiter
                        spin = waiter.window()
                        try:
                            packet, got, truncated, missed = packets.call(sock, frame(req), spin, REPLY_TIMEOUT)
                        except OSError:
                            self._raise_refusal(sock)
                            raise
                        if missed:
                            waiter.missed()
                        elif spin:
                            waiter.misses = 0
                        if len(packet) == hot.size and len(got) == hot.fds and not truncated:
                            fields = hot.struct.unpack(packet)
                            if fields[0] == hot.start and fields[1] == req and fields[2] == hot.length:
                                return fields, got
                        if not packet and not got:
                            raise ConnectionResetError("the broker closed the connection")
                        return self._hot_other(packet, got, truncated, req, asked, hot)
                    except AclError:
                        raise
                    except OSError as exc:
                        self._failed(exc, tries)
                raise AssertionError("unreachable")
            finally:
                self._owner = None

    def busy_in_this_thread(self) -> bool:
        """Whether this thread is inside a request (a finalizer run by the garbage collector must wait)."""
        return self._owner == get_ident()

    def _locked(self, attempt: Callable[Concatenate[socket.socket, Args], T], *args: Args.args,
                **kwargs: Args.kwargs) -> T:
        """`attempt(sock, *args)` on the connection, one thread at a time; on a fresh connection again if the broker
        went away."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                for tries in range(RETRIES):
                    try:
                        return attempt(self._sock or self._reconnect(), *args, **kwargs)
                    except AclError:
                        raise
                    except OSError as exc:
                        self._failed(exc, tries)
                raise AssertionError("unreachable")
            finally:
                self._owner = None

    def _failed(self, exc: OSError, tries: int) -> None:
        """After attempt `tries` failed with `exc`: the connection reset, then IpcError for a broker that does not
        answer (it is not gone: no retries pile up) or one lost on the last attempt; otherwise the caller retries on
        a fresh connection (the broker went away: a restart, an idle exit, a kill)."""
        self._reset()
        if isinstance(exc, TimeoutError):
            raise IpcError(f"no reply from the broker at {self.path}: {exc}") from None
        if tries == RETRIES - 1:
            raise IpcError(f"lost the broker at {self.path}: {exc}") from None

    def _hold_of(self, token: int) -> int:
        """The broker's hold id for a token (0, which no hold has, when the broker that gave it is gone)."""
        return self._holds.get(token, 0)

    # ------------------------------------------------------------ the Node protocol

    def charge(
        self, device: int, size: int, meanwhile: Callable[[], None] | None = None, gpu: bool = False
    ) -> int:
        charge = P.ChargeGpu(device, size) if gpu else P.Charge(device, size)
        reply, _ = self.request(charge, P.Token, meanwhile=meanwhile)
        token = next(self._tokens)
        self._holds[token] = reply.hold
        self._charges[token] = charge
        return token

    def release(self, token: int) -> None:
        self._charges.pop(token, None)
        if token not in self._holds:
            return
        try:
            self._hot_request(lambda req: RELEASE.struct.pack(RELEASE.start, req, RELEASE.length,
                                                              self._holds.get(token, 0)), P.Msg.RELEASE, OK)
        finally:
            self._holds.pop(token, None)

    def mem_info(self, device: int) -> tuple[int, int]:
        reply, _ = self.request(P.MemInfo(device), P.Mem)
        return reply.free, reply.total

    def export(
        self, token: int, fd: int, prop: PhysicalProp, size: int, flags: int, share_type: int, pids: list[int],
        gpu: bool = False,
    ) -> bytes:
        """Export a charge's memory (`fd` travels with it); the broker's shareable handle bytes.

        `request` and `_exchange` of an EXPORT, written out so that its frame is packed from these values (the
        codec's `encode_fields`: the same bytes and errors as encoding a P.Export) without a message object made and
        read back. The hold is read on each attempt: after a reconnection the new broker knows it by another."""
        layout, loc = P.LAYOUTS[P.Msg.EXPORT], prop.location
        fixed = (size, flags, share_type, self.config.server_id, int(gpu), prop.handle_type, prop.allocation_type,
                 prop.mem_attr, loc.type, loc.id)
        trust, fds = tuple(pids), (fd,)

        def attempt(sock: socket.socket) -> P.Exported:
            req = next(self._req) & 0xFFFFFFFF or next(self._req)  # 0 addresses the broker's refusal of a connection
            frame = P.LOCAL.encode_fields(layout, req, (self._hold_of(token), *fixed), trust)
            packet, got, truncated = self._send_and_wait(sock, frame, fds, None)
            return self._reply(packet, got, truncated, req, P.Exported, layout.name)

        return self._locked(attempt).shareable

    def revoke(self, token: int) -> None:
        if token in self._holds:
            self.request(lambda: P.Revoke(self._hold_of(token)), P.Ok)

    def set_pids(self, shareable: int, share_type: int, pids: list[int]) -> None:
        self.request(P.SetPids(shareable, share_type, tuple(pids)), P.Ok)

    def import_handle(self, shareable: int, share_type: int, secret: bytes) -> Imported:
        secret = secret.ljust(32, b"\0")
        try:  # values that do not fit (struct.error, before anything is sent): the codec's error says which
            if len(secret) != 32:  # (the struct would cut it)
                raise struct.error
            fields, fds = self._hot_request(
                lambda req: IMPORT.struct.pack(IMPORT.start, req, IMPORT.length, shareable, share_type, secret),
                P.Msg.IMPORT, IMPORTED)
        except struct.error:
            encode(P.Import(shareable, share_type, secret), 1)
            raise
        _, _, _, hold, size, kind, *prop = fields
        token = next(self._tokens)
        self._holds[token] = hold
        return Imported(fds[0], token, size, prop_of(*prop), bool(kind))

    def bare_tgid(self) -> int:
        reply, _ = self.request(P.BareTgid(), P.Pid)
        return reply.pid

    def import_remote(self, handle: bytes) -> RemoteImported:
        """A FABRIC handle of another server, imported through this node's broker (which asks the exporter's)."""
        reply, _ = self.request(P.RemoteImport(handle), P.RemoteImported)
        token = next(self._tokens)
        self._holds[token] = reply.hold
        prop = prop_of(reply.handle_type, reply.allocation_type, reply.mem_attr, reply.location_type,
                       reply.location_id)
        # the process's own namespace in the node's metadata service: its engine finds its holds' segments there
        self._metadata = f"http://127.0.0.1:{reply.metadata_port}/{reply.metadata_token.hex()}/metadata"
        return RemoteImported(token, reply.size, prop, reply.segment, reply.address, self._metadata)

    def set_remote_pids(self, shareable: int, share_type: int, server: int, pids: list[int]) -> None:
        self.request(P.SetRemotePids(shareable, share_type, server, tuple(pids)), P.Ok)

    @property
    def metadata_url(self) -> str:
        """Where this process's transfer engine finds its remote holds (its namespace in the node's metadata
        service; P2PHANDSHAKE before its first remote import)."""
        return self._metadata

    def transfers(self) -> Transfers:
        from ..fabric.engine import process_engine

        config = self.config
        return process_engine(config.fabric_addr or "127.0.0.1", "tcp" if config.fabric == "off" else config.fabric,
                              config.fabric_timeout, self._metadata)

    def listing(self) -> dict[str, Any]:
        """Every export on the node (what `vmmshare ls` shows), following the broker's pages."""
        offset: int | None = 0
        result: dict[str, Any] = {}
        rows: list[Any] = []
        used: dict[str, int] = {}
        gpu_used: dict[str, int] = {}
        while offset is not None:
            reply, _ = self.request(P.List(offset), P.Listing)
            try:
                page = json.loads(reply.page)
                rows.extend(page.pop("exports"))
                used.update(page.pop("used", {}))
                gpu_used.update(page.pop("gpu_used", {}))
                after = page.pop("next")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise IpcError(f"the broker at {self.path} sent a listing page that cannot be read ({exc}); "
                               "it may be of another vmmshare version") from None
            if after is not None and (not isinstance(after, int) or after <= offset):
                raise IpcError(f"the broker at {self.path} sent a listing page that does not move on")
            offset = after
            result = page
        result["used"], result["gpu_used"], result["exports"] = used, gpu_used, rows
        return result


def _refusal(sock: socket.socket) -> AclError | None:
    """The broker's refusal of this connection (an ERROR to request 0) if it left one on `sock` before closing it."""
    try:
        packet, got, _ = packets.recv_packet(sock, DONTWAIT)
    except OSError:
        return None
    close_fds(got)
    try:
        req, reply = decode(packet, len(got))
    except ProtocolError:
        return None
    return error_from_code(reply.code, reply.message) if req == 0 and isinstance(reply, P.Error) else None


class _Waiter:
    """Waits for the broker's reply: polls for a few microseconds first (a wake-up from sleep costs far more
    on most machines than the broker takes to answer), then sleeps in poll(2), up to REPLY_TIMEOUT.

    Polling pays only while a core is free for it (`spin` gives up as soon as another task wants the core) and
    replies come quickly. After a poll that missed (the reply outlasted the window, or every core was busy when the
    poll would start), the next requests wait without polling: 1, then 3, 7, 15 and at most SKIP_AFTER_MISS after
    each further miss in a row, and the count starts over once a poll finds its reply. A machine that stays busy (a
    busy broker, many clients on few cores) is looked at once in 17 requests; one busy moment (the process that
    handed this one a handle, still running for a few microseconds) costs only the next request's poll.
    """

    SKIP_AFTER_MISS = 16

    def __init__(self, spin: float) -> None:
        self.spin = spin  # seconds (the Config's, from VMMSHARE_SPIN_US)
        self.skip = 0  # requests left to wait for without polling
        self.misses = 0  # how many the last miss made skip: doubled (plus one) by the next miss in a row

    def window(self) -> float:
        """Seconds the next wait may poll: none for a while after a poll that missed. Whether a core is free is for
        the call to see (`packets.call`), at the moment it would poll."""
        if self.skip:
            self.skip -= 1
            return 0.0
        return self.spin

    def missed(self) -> None:
        """A poll missed its reply: skip polling for the next requests, twice as many (and one) as the last miss."""
        self.skip = self.misses = min(2 * self.misses + 1, self.SKIP_AFTER_MISS)

    def _after(self, spin: float, missed: bool) -> None:
        if missed:
            self.missed()
        elif spin:
            self.misses = 0

    def call(self, sock: socket.socket, frame: bytes) -> tuple[bytes, list[int], bool]:
        """Send `frame` (no fds) and wait for the reply as `wait` does, in one call (`packets.call`)."""
        spin = self.window()
        packet, got, truncated, missed = packets.call(sock, frame, spin, REPLY_TIMEOUT)
        self._after(spin, missed)
        return packet, got, truncated

    def wait(self, sock: socket.socket) -> tuple[bytes, list[int], bool]:
        """The reply to a request already sent (`packets.wait`)."""
        spin = self.window()
        packet, got, truncated, missed = packets.wait(sock, spin, REPLY_TIMEOUT)
        self._after(spin, missed)
        return packet, got, truncated
