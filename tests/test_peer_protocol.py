"""The broker-to-broker format (fabric/peer_protocol.py) byte for byte, its stream reader, and the key handshake.

The literals are written from the format description (header: magic ``b"VF"``, version 1, type, request id, body
length, little-endian), never computed from the codec's tables. The handshake cases play the attacker: a wrong
key, a proof replayed on another connection, a proof reflected back to its maker, a peer claiming our own id.
"""

from __future__ import annotations

import pytest

from vmmshare.fabric import peer_protocol as F
from vmmshare.fabric.peer_protocol import AuthError, Frame, FrameReader, PeerProtocolError


def h(text: str) -> bytes:
    return bytes.fromhex(text)


N1 = bytes(range(32))
N2 = bytes(range(32, 64))
P32 = bytes([0xAB]) * 32

CASES = [
    ("hello", 1, F.Hello(0x11223344, N1), "5646 01 01 01000000 24000000  44332211" + N1.hex()),
    ("challenge", 2, F.Challenge(7, N2, P32), "5646 01 02 02000000 44000000  07000000" + N2.hex() + P32.hex()),
    ("proof", 3, F.Proof(P32), "5646 01 03 03000000 20000000" + P32.hex()),
    ("welcome", 4, F.Welcome(), "5646 01 04 04000000 00000000"),
    ("import", 0x0A0B0C0D,
     F.Import(shareable=0x0102030405060708, share_type=2, secret=N1, server_id=0xBEEF, pid=4242, uid=1000, tag=9),
     "5646 01 10 0d0c0b0a 3d000000  0807060504030201 02" + N1.hex() + " efbe0000 92100000 e8030000 0900000000000000"),
    ("release", 5, F.Release(0xFFFFFFFFFFFFFFFF), "5646 01 11 05000000 08000000 ffffffffffffffff"),
    ("heartbeat", 6, F.Heartbeat(), "5646 01 12 06000000 00000000"),
    ("adopt", 7, F.Adopt(3), "5646 01 13 07000000 08000000 0300000000000000"),
    ("ok", 8, F.Ok(), "5646 01 40 08000000 00000000"),
    ("error", 9, F.Error(107017, "gone"), "5646 01 41 09000000 08000000  09a20100 676f6e65"),
    ("imported", 10,
     F.Imported(hold=1, size=0x200000, memory_kind=0, handle_type=0, allocation_type=0, mem_attr=5, location_type=1,
                location_id=-1, address=0x7F0000001000, segment="10.0.0.1:15001"),
     "5646 01 42 0a000000 2f000000  0100000000000000 0000200000000000 00 00 00 05 01 ffffffff 00100000007f0000"
     + b"10.0.0.1:15001".hex()),
]


@pytest.mark.parametrize(("req", "message", "packet"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_message_is_pinned_byte_for_byte(req: int, message: F.PeerMessage, packet: str) -> None:
    raw = h(packet)
    assert F.encode(message, req) == raw
    assert F.decode(raw) == Frame(req, message)


def test_every_kind_has_a_pinned_case() -> None:
    assert {c[2].KIND for c in CASES} == set(F.Kind)


@pytest.mark.parametrize(("raw", "why"), [
    (b"", "shorter"),
    (h("5642 01 04 00000000 00000000"), "magic"),  # the local broker's magic: not this protocol
    (h("5646 02 04 00000000 00000000"), "version"),
    (h("5646 01 63 00000000 00000000"), "unknown message type"),
    (h("5646 01 04 00000000 01000000 00"), "body of 1 bytes"),  # WELCOME has no body
    (h("5646 01 11 00000000 07000000 00000000000000"), "body of 7"),
    (h("5646 01 11 00000000 08000000 0000000000000000 00"), "header says"),  # a trailing byte
    (h("5646 01 41 00000000 06000000 01000000 ff fe"), "UTF-8"),
    (h("5646 01 41 00000000 05040000") + bytes(0x405), "body of 1029"),  # text beyond its limit
])
def test_bad_frames_are_refused_with_a_reason(raw: bytes, why: str) -> None:
    with pytest.raises(PeerProtocolError, match=why):
        F.decode(raw)


def test_encode_refuses_values_that_do_not_fit() -> None:
    with pytest.raises(PeerProtocolError):
        F.encode(F.Hello(1, b"short"), 1)
    with pytest.raises(PeerProtocolError):
        F.encode(F.Release(-1), 1)
    with pytest.raises(PeerProtocolError):
        F.encode(F.Imported(1, 1, 0, 0, 0, 5, 1, 0, 0, "x" * 300), 1)
    with pytest.raises(PeerProtocolError):
        F.encode(object(), 1)  # type: ignore[arg-type]
    long_error = F.decode(F.encode(F.Error(1, "é" * 1000), 1)).message
    assert isinstance(long_error, F.Error) and 0 < len(long_error.message.encode()) <= F.MAX_TEXT


def test_the_reader_cuts_a_stream_fed_byte_by_byte_and_in_bulk() -> None:
    frames = [F.encode(c[2], c[1]) for c in CASES]
    stream = b"".join(frames)
    one = FrameReader()
    got = [f for i in range(len(stream)) for f in one.feed(stream[i : i + 1])]
    assert got == [Frame(c[1], c[2]) for c in CASES] and one.buffered == 0
    bulk = FrameReader()
    assert bulk.feed(stream) == got


def test_the_reader_refuses_a_bad_header_before_buffering_its_body() -> None:
    reader = FrameReader()
    with pytest.raises(PeerProtocolError, match="body of"):
        reader.feed(h("5646 01 11 00000000 ffffff7f"))  # a 2 GiB body announced: refused at once
    reader = FrameReader()
    with pytest.raises(PeerProtocolError, match="magic"):
        reader.feed(b"GET / HTTP/1.1\r\n")


# ---------------------------------------------------------------- the cluster key handshake

KEY = bytes(range(64))


def handshake(client_key: bytes, server_key: bytes, a: int = 1, b: int = 2) -> tuple[F.Initiator, F.Responder]:
    ini, res = F.Initiator(client_key, a), F.Responder(server_key, b)
    challenge = res.challenge(ini.hello())
    res.verify(ini.answer(challenge))
    return ini, res


def test_both_sides_prove_the_key_and_learn_each_others_id() -> None:
    ini, res = handshake(KEY, KEY, 0xA, 0xB)
    assert ini.peer_id == 0xB and res.peer_id == 0xA
    assert ini.nonce != res.nonce and len(ini.nonce) == len(res.nonce) == 32


def test_a_wrong_key_fails_on_either_side() -> None:
    with pytest.raises(AuthError, match="cluster key"):  # the accepting broker has another key: the client sees it
        handshake(KEY, bytes(64))
    ini, res = F.Initiator(bytes(64), 1), F.Responder(KEY, 2)
    challenge = res.challenge(ini.hello())
    forged = F.Proof(F.proof(bytes(64), b"initiator", 1, 2, ini.nonce, res.nonce))
    with pytest.raises(AuthError, match="did not prove"):  # a client with another key: the server refuses
        res.verify(forged)
    assert challenge.proof != forged.proof


def test_a_recorded_proof_does_not_open_another_connection() -> None:
    first_ini, first_res = F.Initiator(KEY, 1), F.Responder(KEY, 2)
    recorded = first_ini.answer(first_res.challenge(first_ini.hello()))
    first_res.verify(recorded)
    replay = F.Responder(KEY, 2)  # a fresh connection: fresh nonce, so the old proof is worthless
    replay.challenge(F.Hello(1, first_ini.nonce))
    with pytest.raises(AuthError):
        replay.verify(recorded)


def test_a_proof_reflected_back_to_its_maker_is_refused() -> None:
    """An attacker without the key relays the responder's own proof as the initiator's: the role differs."""
    res = F.Responder(KEY, 2)
    attacker_nonce = bytes(32)
    challenge = res.challenge(F.Hello(1, attacker_nonce))
    with pytest.raises(AuthError):
        res.verify(F.Proof(challenge.proof))
    ini = F.Initiator(KEY, 1)
    own = F.Proof(F.proof(KEY, b"initiator", 1, 2, ini.nonce, N2))
    with pytest.raises(AuthError):  # ...and the initiator's proof, played back as a challenge, fails there
        ini.answer(F.Challenge(2, N2, own.proof))


def test_a_proof_is_bound_to_both_server_ids() -> None:
    ini, res = F.Initiator(KEY, 1), F.Responder(KEY, 2)
    challenge = res.challenge(ini.hello())
    with pytest.raises(AuthError):  # the same proof presented as coming from server 3
        ini.answer(F.Challenge(3, challenge.nonce, challenge.proof))


def test_a_peer_claiming_our_own_server_id_is_refused() -> None:
    with pytest.raises(AuthError, match="own id"):
        F.Responder(KEY, 5).challenge(F.Hello(5, N1))
    with pytest.raises(AuthError, match="own id"):
        F.Initiator(KEY, 5).answer(F.Challenge(5, N2, P32))


def test_a_proof_before_the_hello_is_refused() -> None:
    with pytest.raises(AuthError, match="before the hello"):
        F.Responder(KEY, 2).verify(F.Proof(P32))
