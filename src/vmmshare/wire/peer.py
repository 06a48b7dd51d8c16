"""The broker-to-broker wire format over TCP, encode/decode only (no I/O), so it can be tested and fuzzed on its own.

A frame is the shared framing's (framing.py): a 12-byte header (magic ``b"VF"``, version, message type, request id,
body length) and a body: a fixed struct and, for some types, a UTF-8 text tail. A TCP stream carries frames back to
back; `FrameReader` cuts them out, refusing a bad header before it buffers the body. Decoding is strict, as the local
protocol's is.

Before any request, the two brokers prove the cluster key to each other (`Initiator`, `Responder`): each sends a
fresh 32-byte nonce, and each proof is HMAC-SHA256 under the key over the handshake's transcript (both server ids,
both nonces, and the endpoint the connecting broker dialed, which the accepting one checks against its own) and the
prover's role. A proof is therefore good for one connection, one direction, one pair of servers and one endpoint:
a handshake relayed through a listener of someone else's (another endpoint), reflected or replayed fails.

The handshake's transcript and the key give a key per direction (`session_keys`); every frame after the proofs
carries HMAC-SHA256 under its direction's key over its sequence number (counted, never sent) and its bytes
(`Sealer`, `FrameReader.authenticate`), so a frame tampered with, replayed, reordered, dropped, sent back the way it
came or moved to another link fails its check and closes the link. Frames are authenticated, not encrypted: the
one secret a request carries (a FABRIC handle's) travels as a proof bound to the link (`secret_proof`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import secrets
import struct
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .framing import HEADER, PROP, Framing, Layout, Tail

MAGIC = b"VF"
VERSION = 3  # 2: endpoint-bound proofs, sealed frames, secrets proved, not sent; 3: links used both ways (Listens)
MAX_BODY = 4096
NONCE = 32
MAX_SEGMENT = 255  # bytes of an engine segment name ("<address>:<port>")
MAX_TEXT = 1024  # bytes of an error message
TAG = 32  # bytes of the MAC after each frame once the handshake is done
_LABEL = b"vmmshare-fabric/2"


class PeerProtocolError(ValueError):
    """A frame that does not follow the protocol: the connection is closed."""


class AuthError(PeerProtocolError):
    """The peer did not prove the cluster key (or proved it for another connection, direction or server)."""


class Kind(enum.IntEnum):
    """Message type numbers: part of the format (brokers of different builds meet on the wire)."""

    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    WELCOME = 4
    IMPORT = 16
    RELEASE = 17
    HEARTBEAT = 18
    ADOPT = 19
    LISTENS = 20
    OK = 64
    ERROR = 65
    IMPORTED = 66


class PeerMessage:
    __slots__ = ()
    KIND: ClassVar[Kind]


@dataclass(frozen=True, slots=True)
class Hello(PeerMessage):
    """The connecting broker: its server id and nonce."""

    KIND: ClassVar[Kind] = Kind.HELLO
    server_id: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Challenge(PeerMessage):
    """The accepting broker: its server id, its nonce, and its proof of the key."""

    KIND: ClassVar[Kind] = Kind.CHALLENGE
    server_id: int
    nonce: bytes
    proof: bytes


@dataclass(frozen=True, slots=True)
class Proof(PeerMessage):
    """The connecting broker's proof of the key."""

    KIND: ClassVar[Kind] = Kind.PROOF
    proof: bytes


@dataclass(frozen=True, slots=True)
class Welcome(PeerMessage):
    """The accepting broker took the proof: requests may follow."""

    KIND: ClassVar[Kind] = Kind.WELCOME


@dataclass(frozen=True, slots=True)
class Import(PeerMessage):
    """Import an export of the receiving node for a process of the sending one: the handle's value, share type,
    a proof of its secret bound to this link (`secret_proof`), and the importer as its own broker learnt it from its
    kernel (server, pid, uid, an identity tag)."""

    KIND: ClassVar[Kind] = Kind.IMPORT
    shareable: int
    share_type: int
    secret_proof: bytes
    server_id: int
    pid: int
    uid: int
    tag: int


@dataclass(frozen=True, slots=True)
class Release(PeerMessage):
    """The importer is done with a remote hold (it freed the memory, or died)."""

    KIND: ClassVar[Kind] = Kind.RELEASE
    hold: int


@dataclass(frozen=True, slots=True)
class Heartbeat(PeerMessage):
    KIND: ClassVar[Kind] = Kind.HEARTBEAT


@dataclass(frozen=True, slots=True)
class Adopt(PeerMessage):
    """After a new connection: a remote hold the sending broker still has, to be tied to this connection."""

    KIND: ClassVar[Kind] = Kind.ADOPT
    hold: int


@dataclass(frozen=True, slots=True)
class Listens(PeerMessage):
    """The connecting broker's own endpoint (`endpoint_bytes`), so that the accepting one sends its requests to it
    over this link too: one link per pair of servers. Taken only for the address the connection comes from."""

    KIND: ClassVar[Kind] = Kind.LISTENS
    endpoint: bytes


@dataclass(frozen=True, slots=True)
class Ok(PeerMessage):
    KIND: ClassVar[Kind] = Kind.OK


@dataclass(frozen=True, slots=True)
class Error(PeerMessage):
    KIND: ClassVar[Kind] = Kind.ERROR
    code: int
    message: str


@dataclass(frozen=True, slots=True)
class Imported(PeerMessage):
    """A remote import: the hold, the memory's size, kind and properties, the address of the hold's own
    registration, and where the exporting engine takes transfers (`segment`: its data "<address>:<port>")."""

    KIND: ClassVar[Kind] = Kind.IMPORTED
    hold: int
    size: int
    memory_kind: int
    handle_type: int
    allocation_type: int
    mem_attr: int
    location_type: int
    location_id: int
    address: int
    segment: str


class Frame(NamedTuple):
    req: int
    message: PeerMessage


def _layout(cls: type[PeerMessage], fmt: str, text: int = 0, cut: bool = False) -> Layout:
    """A message type's layout: its fixed struct and, when `text`, a text tail of up to that many bytes (cut when
    `cut`, refused otherwise)."""
    return Layout(cls, cls.KIND, fmt, Tail.TEXT if text else Tail.NONE, text, cut=cut)


LAYOUTS: dict[Kind, Layout] = {
    Kind(layout.kind): layout
    for layout in (
        _layout(Hello, "<I32s"),
        _layout(Challenge, "<I32s32s"),
        _layout(Proof, "<32s"),
        _layout(Welcome, "<"),
        _layout(Import, "<QB32sIIIQ"),
        _layout(Release, "<Q"),
        _layout(Heartbeat, "<"),
        _layout(Adopt, "<Q"),
        _layout(Listens, "<18s"),
        _layout(Ok, "<"),
        _layout(Error, "<I", MAX_TEXT, cut=True),  # an error message is cut, not lost
        _layout(Imported, "<QQB" + PROP.format + "Q", MAX_SEGMENT),
    )
}
PEER: Framing[PeerMessage, Frame] = Framing("fabric protocol", MAGIC, VERSION, MAX_BODY, PeerProtocolError, Frame,
                                            LAYOUTS.values())
encode = PEER.encode  # (message, req) -> one frame; PeerProtocolError if its values do not fit its type
decode = PEER.decode  # (frame) -> Frame of one whole frame


class FrameReader:
    """Cuts frames out of a byte stream; a bad header is refused as soon as its 12 bytes are in. Once
    `authenticate` is called, every further frame must carry its MAC (TAG bytes after the body), checked before
    the body is decoded."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need = 0  # the whole frame's length (with its MAC) once its header is read
        self._key: bytes | None = None
        self._seq = 0

    def authenticate(self, key: bytes) -> None:
        """From the next frame on, each must carry HMAC-SHA256 under `key` over its sequence number and bytes."""
        if self._need:
            raise PeerProtocolError("the frames' authentication cannot start in the middle of a frame")
        self._key, self._seq = key, 0

    def push(self, data: bytes) -> None:
        self._buf += data

    def next(self) -> Frame | None:
        """The next whole frame in the buffer (None until one is in); PeerProtocolError (AuthError for a MAC that
        does not check) when it breaks the protocol."""
        tag = TAG if self._key is not None else 0
        if not self._need:
            if len(self._buf) < HEADER.size:
                return None
            self._need = HEADER.size + PEER.header(self._buf)[2] + tag
        if len(self._buf) < self._need:
            return None
        frame, self._need = bytes(self._buf[: self._need]), 0
        del self._buf[: len(frame)]
        if self._key is not None:
            frame, mac = frame[:-TAG], frame[-TAG:]
            if not hmac.compare_digest(mac, _mac(self._key, self._seq, frame)):
                raise AuthError(f"frame {self._seq} after the handshake failed its check: tampered with, replayed, "
                                "reordered, or made for another link or direction")
            self._seq += 1
        return decode(frame)

    def feed(self, data: bytes) -> list[Frame]:
        """Buffer `data` and return every whole frame it completes."""
        self.push(data)
        out: list[Frame] = []
        while (frame := self.next()) is not None:
            out.append(frame)
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


def _mac(key: bytes, seq: int, frame: bytes) -> bytes:
    return hmac.new(key, struct.pack("<Q", seq) + frame, "sha256").digest()


class Sealer:
    """The sending side of one direction of a link: each frame gets its MAC under `key` and the next sequence
    number (the receiver counts the same numbers, so none is sent)."""

    def __init__(self, key: bytes) -> None:
        self._key, self._seq = key, 0

    def seal(self, frame: bytes) -> bytes:
        mac = _mac(self._key, self._seq, frame)
        self._seq += 1
        return frame + mac


# ---------------------------------------------------------------- proving the cluster key


def endpoint_bytes(address: str, port: int) -> bytes:
    """An endpoint as the transcript names it: the address's 16 bytes (IPv4 zero-padded) and the port."""
    try:
        raw = ipaddress.ip_address(address).packed
    except ValueError:
        raise PeerProtocolError(f"{address!r} is not an IP address") from None
    if not 0 <= port <= 0xFFFF:
        raise PeerProtocolError(f"port {port} is out of range")
    return raw.ljust(16, b"\0") + struct.pack("<H", port)


def transcript(initiator: int, responder: int, initiator_nonce: bytes, responder_nonce: bytes,
               endpoint: bytes) -> bytes:
    """What both proofs and both session keys are bound to: the servers, the nonces and the dialed endpoint."""
    return (_LABEL + struct.pack("<II", initiator, responder) + initiator_nonce + responder_nonce
            + struct.pack("<B", len(endpoint)) + endpoint)


def proof(key: bytes, role: bytes, text: bytes) -> bytes:
    """HMAC-SHA256 under the cluster key over the prover's role and the transcript."""
    return hmac.new(key, _LABEL + b" proof " + role + b" " + text, "sha256").digest()


class SessionKeys(NamedTuple):
    """The keys of one link, one per direction, and the link's id (a hash of its transcript)."""

    initiator_to_responder: bytes
    responder_to_initiator: bytes
    session: bytes


def session_keys(key: bytes, text: bytes) -> SessionKeys:
    """The link's keys: HMAC-SHA256 under the cluster key over a label naming the direction and the transcript."""
    digest = hashlib.sha256(text).digest()
    return SessionKeys(hmac.new(key, _LABEL + b" key initiator->responder " + digest, "sha256").digest(),
                       hmac.new(key, _LABEL + b" key responder->initiator " + digest, "sha256").digest(),
                       digest)


def secret_proof(secret: bytes, session: bytes) -> bytes:
    """What an Import carries instead of a FABRIC handle's secret: HMAC-SHA256 under the secret over the link's id,
    so the secret never crosses the network and a proof seen on one link is worthless on any other."""
    return hmac.new(secret, _LABEL + b" secret " + session, "sha256").digest()


class Initiator:
    """The connecting broker's side of the handshake: hello, then check the challenge and answer it. `endpoint`
    is the one it dialed (`endpoint_bytes`): the responder's proof must be for that endpoint."""

    def __init__(self, key: bytes, server_id: int, endpoint: bytes, nonce: bytes | None = None) -> None:
        self.key, self.server_id, self.endpoint = key, server_id, endpoint
        self.nonce = nonce if nonce is not None else secrets.token_bytes(NONCE)
        self.peer_id: int | None = None
        self.keys: SessionKeys | None = None

    def hello(self) -> Hello:
        return Hello(self.server_id, self.nonce)

    def answer(self, challenge: Challenge) -> Proof:
        """The proof to send, once the responder proved the key for this connection (AuthError if it did not)."""
        if challenge.server_id == self.server_id:
            raise AuthError(f"the peer claims this server's own id {self.server_id:#x}")
        text = transcript(self.server_id, challenge.server_id, self.nonce, challenge.nonce, self.endpoint)
        if not hmac.compare_digest(proof(self.key, b"responder", text), challenge.proof):
            raise AuthError("the peer did not prove the cluster key for the endpoint dialed (another "
                            "VMMSHARE_CLUSTER_KEY_FILE, or a relay: the broker that answered listens elsewhere)")
        self.peer_id = challenge.server_id
        self.keys = session_keys(self.key, text)
        return Proof(proof(self.key, b"initiator", text))


class Responder:
    """The accepting broker's side: answer the hello with a challenge, then check the initiator's proof.
    `endpoint` is the one this broker listens on (`endpoint_bytes`)."""

    def __init__(self, key: bytes, server_id: int, endpoint: bytes, nonce: bytes | None = None) -> None:
        self.key, self.server_id, self.endpoint = key, server_id, endpoint
        self.nonce = nonce if nonce is not None else secrets.token_bytes(NONCE)
        self._text: bytes | None = None
        self._hello: Hello | None = None
        self.peer_id: int | None = None
        self.keys: SessionKeys | None = None

    def challenge(self, hello: Hello) -> Challenge:
        if hello.server_id == self.server_id:
            raise AuthError(f"the peer claims this server's own id {self.server_id:#x}")
        if self._hello is not None:
            raise AuthError("a second hello on one connection")
        self._hello = hello
        self._text = transcript(hello.server_id, self.server_id, hello.nonce, self.nonce, self.endpoint)
        return Challenge(self.server_id, self.nonce, proof(self.key, b"responder", self._text))

    def verify(self, answer: Proof) -> int:
        """The peer's server id once its proof checks out (AuthError otherwise)."""
        if self._hello is None or self._text is None:
            raise AuthError("a proof before the hello")
        if self.peer_id is not None:
            raise AuthError("a second proof on one connection")
        if not hmac.compare_digest(proof(self.key, b"initiator", self._text), answer.proof):
            raise AuthError(f"server {self._hello.server_id:#x} did not prove the cluster key for this connection")
        self.peer_id = self._hello.server_id
        self.keys = session_keys(self.key, self._text)
        return self.peer_id
