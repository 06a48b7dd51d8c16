"""The broker-to-broker format (wire/peer.py) byte for byte, its stream reader, and the key handshake.

The literals are written from the format description (header: magic ``b"VF"``, version 3, type, request id, body
length, little-endian), never computed from the codec's tables. The handshake cases play the attacker: a wrong
key, a proof replayed on another connection, a proof reflected back to its maker, a peer claiming our own id, a
handshake relayed through another endpoint; and the sealed frames after it: tampered with, replayed, reordered,
dropped, sent back the way they came or moved to another link (SPEC §8).
"""

from __future__ import annotations

import pytest

from vmmshare.wire import peer as F
from vmmshare.wire.peer import AuthError, Frame, FrameReader, PeerProtocolError


def h(text: str) -> bytes:
    return bytes.fromhex(text)


N1 = bytes(range(32))
N2 = bytes(range(32, 64))
P32 = bytes([0xAB]) * 32

CASES = [
    ("hello", 1, F.Hello(0x11223344, N1), "5646 03 01 01000000 24000000  44332211" + N1.hex()),
    ("challenge", 2, F.Challenge(7, N2, P32), "5646 03 02 02000000 44000000  07000000" + N2.hex() + P32.hex()),
    ("proof", 3, F.Proof(P32), "5646 03 03 03000000 20000000" + P32.hex()),
    ("welcome", 4, F.Welcome(), "5646 03 04 04000000 00000000"),
    ("import", 0x0A0B0C0D,
     F.Import(shareable=0x0102030405060708, share_type=2, secret_proof=N1, server_id=0xBEEF, pid=4242, uid=1000, tag=9),
     "5646 03 10 0d0c0b0a 3d000000  0807060504030201 02" + N1.hex() + " efbe0000 92100000 e8030000 0900000000000000"),
    ("release", 5, F.Release(0xFFFFFFFFFFFFFFFF), "5646 03 11 05000000 08000000 ffffffffffffffff"),
    ("heartbeat", 6, F.Heartbeat(), "5646 03 12 06000000 00000000"),
    ("adopt", 7, F.Adopt(3), "5646 03 13 07000000 08000000 0300000000000000"),
    ("listens", 11, F.Listens(F.endpoint_bytes("10.0.0.1", 17017)),
     "5646 03 14 0b000000 12000000 0a000001" + "00" * 12 + "7942"),
    ("ok", 8, F.Ok(), "5646 03 40 08000000 00000000"),
    ("error", 9, F.Error(107017, "gone"), "5646 03 41 09000000 08000000  09a20100 676f6e65"),
    ("imported", 10,
     F.Imported(hold=1, size=0x200000, memory_kind=0, handle_type=0, allocation_type=0, mem_attr=5, location_type=1,
                location_id=-1, address=0x7F0000001000, segment="10.0.0.1:15001"),
     "5646 03 42 0a000000 2f000000  0100000000000000 0000200000000000 00 00 00 05 01 ffffffff 00100000007f0000"
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
    (h("5642 02 04 00000000 00000000"), "magic"),  # the local broker's magic: not this protocol
    (h("5646 01 04 00000000 00000000"), "version"),  # the first protocol: refused
    (h("5646 02 04 00000000 00000000"), "version"),  # the second (no Listens): refused, not misread
    (h("5646 03 63 00000000 00000000"), "unknown message type"),
    (h("5646 03 04 00000000 01000000 00"), "body of 1 bytes"),  # WELCOME has no body
    (h("5646 03 11 00000000 07000000 00000000000000"), "body of 7"),
    (h("5646 03 11 00000000 08000000 0000000000000000 00"), "header says"),  # a trailing byte
    (h("5646 03 41 00000000 06000000 01000000 ff fe"), "UTF-8"),
    (h("5646 03 41 00000000 05040000") + bytes(0x405), "body of 1029"),  # text beyond its limit
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
        reader.feed(h("5646 03 11 00000000 ffffff7f"))  # a 2 GiB body announced: refused at once
    reader = FrameReader()
    with pytest.raises(PeerProtocolError, match="magic"):
        reader.feed(b"GET / HTTP/1.1\r\n")


# ---------------------------------------------------------------- the cluster key handshake

KEY = bytes(range(64))
EP_B = F.endpoint_bytes("10.0.0.2", 17017)  # where the responder listens, and what an honest initiator dials


def handshake(client_key: bytes, server_key: bytes, a: int = 1, b: int = 2,
              dialed: bytes = EP_B) -> tuple[F.Initiator, F.Responder]:
    ini, res = F.Initiator(client_key, a, dialed), F.Responder(server_key, b, EP_B)
    challenge = res.challenge(ini.hello())
    res.verify(ini.answer(challenge))
    return ini, res


def test_both_sides_prove_the_key_and_learn_each_others_id() -> None:
    ini, res = handshake(KEY, KEY, 0xA, 0xB)
    assert ini.peer_id == 0xB and res.peer_id == 0xA
    assert ini.nonce != res.nonce and len(ini.nonce) == len(res.nonce) == 32
    assert ini.keys == res.keys and ini.keys is not None
    assert ini.keys.initiator_to_responder != ini.keys.responder_to_initiator  # a key per direction


def test_a_wrong_key_fails_on_either_side() -> None:
    with pytest.raises(AuthError, match="cluster key"):  # the accepting broker has another key: the client sees it
        handshake(KEY, bytes(64))
    ini, res = F.Initiator(bytes(64), 1, EP_B), F.Responder(KEY, 2, EP_B)
    challenge = res.challenge(ini.hello())
    forged = F.Proof(F.proof(bytes(64), b"initiator", F.transcript(1, 2, ini.nonce, res.nonce, EP_B)))
    with pytest.raises(AuthError, match="did not prove"):  # a client with another key: the server refuses
        res.verify(forged)
    assert challenge.proof != forged.proof


def test_a_recorded_proof_does_not_open_another_connection() -> None:
    first_ini, first_res = F.Initiator(KEY, 1, EP_B), F.Responder(KEY, 2, EP_B)
    recorded = first_ini.answer(first_res.challenge(first_ini.hello()))
    first_res.verify(recorded)
    replay = F.Responder(KEY, 2, EP_B)  # a fresh connection: fresh nonce, so the old proof is worthless
    replay.challenge(F.Hello(1, first_ini.nonce))
    with pytest.raises(AuthError):
        replay.verify(recorded)


def test_a_proof_reflected_back_to_its_maker_is_refused() -> None:
    """An attacker without the key relays the responder's own proof as the initiator's: the role differs."""
    res = F.Responder(KEY, 2, EP_B)
    attacker_nonce = bytes(32)
    challenge = res.challenge(F.Hello(1, attacker_nonce))
    with pytest.raises(AuthError):
        res.verify(F.Proof(challenge.proof))
    ini = F.Initiator(KEY, 1, EP_B)
    own = F.Proof(F.proof(KEY, b"initiator", F.transcript(1, 2, ini.nonce, N2, EP_B)))
    with pytest.raises(AuthError):  # ...and the initiator's proof, played back as a challenge, fails there
        ini.answer(F.Challenge(2, N2, own.proof))


def test_a_handshake_relayed_from_another_endpoint_fails() -> None:
    """SPEC §8: a keyless attacker makes broker 1 dial its own listener (a made-up handle's endpoint) and relays the
    hello, challenge and proof to broker 2's real port: broker 1 checks the challenge for the endpoint it dialed,
    broker 2 proved it for the one it listens on."""
    relay = F.endpoint_bytes("10.0.0.1", 40001)  # the attacker's listener on broker 1's own server
    ini, res = F.Initiator(KEY, 1, relay), F.Responder(KEY, 2, EP_B)
    challenge = res.challenge(ini.hello())  # relayed as is
    with pytest.raises(AuthError, match="relay"):
        ini.answer(challenge)
    # the attacker cannot make the proof broker 2 wants either: it has no key, and broker 1 never answered
    with pytest.raises(AuthError):
        res.verify(F.Proof(challenge.proof))


def test_a_proof_is_bound_to_both_server_ids() -> None:
    ini, res = F.Initiator(KEY, 1, EP_B), F.Responder(KEY, 2, EP_B)
    challenge = res.challenge(ini.hello())
    with pytest.raises(AuthError):  # the same proof presented as coming from server 3
        ini.answer(F.Challenge(3, challenge.nonce, challenge.proof))


def test_a_peer_claiming_our_own_server_id_is_refused() -> None:
    with pytest.raises(AuthError, match="own id"):
        F.Responder(KEY, 5, EP_B).challenge(F.Hello(5, N1))
    with pytest.raises(AuthError, match="own id"):
        F.Initiator(KEY, 5, EP_B).answer(F.Challenge(5, N2, P32))


def test_a_proof_before_the_hello_or_a_second_hello_or_proof_is_refused() -> None:
    with pytest.raises(AuthError, match="before the hello"):
        F.Responder(KEY, 2, EP_B).verify(F.Proof(P32))
    res = F.Responder(KEY, 2, EP_B)
    res.challenge(F.Hello(1, N1))
    with pytest.raises(AuthError, match="second hello"):
        res.challenge(F.Hello(1, N1))
    _, res = handshake(KEY, KEY)
    with pytest.raises(AuthError, match="second proof"):
        res.verify(F.Proof(P32))


# ---------------------------------------------------------------- sealed frames after the handshake


class Side:
    """One end of a proved link: its sealer and its reader, as link.py sets them up."""

    def __init__(self, send: bytes, receive: bytes) -> None:
        self.sealer, self.reader = F.Sealer(send), FrameReader()
        self.reader.authenticate(receive)

    def sealed(self, message: F.PeerMessage, req: int = 1) -> bytes:
        return self.sealer.seal(F.encode(message, req))


def link_ends(ini: F.Initiator, res: F.Responder) -> tuple[Side, Side]:
    assert ini.keys is not None and res.keys is not None
    return (Side(ini.keys.initiator_to_responder, ini.keys.responder_to_initiator),
            Side(res.keys.responder_to_initiator, res.keys.initiator_to_responder))


def test_sealed_frames_pass_in_order_each_way_and_carry_their_mac() -> None:
    a, b = link_ends(*handshake(KEY, KEY))
    frames = [F.Heartbeat(), F.Release(7), F.Adopt(9)]
    stream = b"".join(a.sealed(m, i) for i, m in enumerate(frames))
    assert len(stream) == sum(len(F.encode(m, 0)) + 32 for m in frames)
    got = [f for i in range(len(stream)) for f in b.reader.feed(stream[i : i + 1])]  # byte by byte
    assert got == [Frame(i, m) for i, m in enumerate(frames)]
    assert a.reader.feed(b.sealed(F.Ok(), 5)) == [Frame(5, F.Ok())]  # and the other way


def test_a_frame_with_one_bit_flipped_anywhere_fails_its_check() -> None:
    ini, res = handshake(KEY, KEY)
    raw = link_ends(ini, res)[0].sealed(F.Release(0x1234), 3)
    for bit in range(len(raw) * 8):
        b = link_ends(ini, res)[1]
        bad = bytearray(raw)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(PeerProtocolError):  # a MAC that does not check, or a header that no longer parses
            b.reader.feed(bytes(bad))


def test_a_frame_without_a_mac_is_refused_once_the_link_is_proved() -> None:
    """An attacker holding the TCP connection (a relay) injects a plain frame of its own."""
    _, b = link_ends(*handshake(KEY, KEY))
    with pytest.raises(AuthError, match="failed its check"):
        b.reader.feed(F.encode(F.Import(5, 2, P32, 1, 4242, 0, 0), 1) + bytes(32))


def test_replayed_reordered_or_dropped_frames_fail() -> None:
    ini, res = handshake(KEY, KEY)
    a, _ = link_ends(ini, res)
    first, second = a.sealed(F.Release(1), 1), a.sealed(F.Release(2), 2)
    _, b = link_ends(ini, res)
    assert b.reader.feed(first) == [Frame(1, F.Release(1))]
    with pytest.raises(AuthError):  # the same frame again
        b.reader.feed(first)
    _, b = link_ends(ini, res)
    with pytest.raises(AuthError):  # the second before the first (or the first dropped)
        b.reader.feed(second)


def test_a_frame_sent_back_the_way_it_came_or_onto_another_link_fails() -> None:
    ini, res = handshake(KEY, KEY)
    a, b = link_ends(ini, res)
    raw = a.sealed(F.Heartbeat(), 1)
    with pytest.raises(AuthError):  # reflected: the initiator's own frame shown to it as the responder's
        a.reader.feed(raw)
    _, other = link_ends(*handshake(KEY, KEY))  # another link of the same two servers, same key
    with pytest.raises(AuthError):
        other.reader.feed(raw)
    assert b.reader.feed(raw) == [Frame(1, F.Heartbeat())]


def test_a_secret_proof_is_bound_to_its_link() -> None:
    one, two = handshake(KEY, KEY)[0].keys, handshake(KEY, KEY)[0].keys
    assert one is not None and two is not None
    secret = bytes(range(100, 132))
    assert F.secret_proof(secret, one.session) != F.secret_proof(secret, two.session)
    assert F.secret_proof(secret, one.session) != secret and len(F.secret_proof(secret, one.session)) == 32


def test_an_endpoint_is_named_by_its_address_and_port() -> None:
    assert F.endpoint_bytes("10.0.0.2", 17017) == bytes([10, 0, 0, 2]) + bytes(12) + (17017).to_bytes(2, "little")
    assert F.endpoint_bytes("::1", 1) == bytes(15) + b"\x01" + b"\x01\x00"
    with pytest.raises(PeerProtocolError):
        F.endpoint_bytes("not-an-address", 1)
