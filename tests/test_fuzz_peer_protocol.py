"""The broker-to-broker decoder under random and mutated input: a frame that re-encodes to the same bytes, or a
PeerProtocolError, nothing else (the live agent under garbage is in test_fabric_security.py)."""

from __future__ import annotations

import random
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from vmmshare.wire import peer as F
from vmmshare.wire.peer import FrameReader, PeerProtocolError

SEED = 20261201

SAMPLES: list[F.PeerMessage] = [
    F.Hello(1, bytes(32)), F.Challenge(2, bytes(32), bytes(32)), F.Proof(bytes(32)), F.Welcome(),
    F.Import(0x1234, 2, bytes(range(32)), 7, 4242, 0, 99), F.Release(5), F.Heartbeat(), F.Adopt(6), F.Ok(),
    F.Error(507022, "peer gone"),
    F.Imported(1, 2 << 20, 0, 0, 0, 5, 1, 0, 0x7F0000000000, "10.1.2.3:15000"),
]


def check(raw: bytes) -> None:
    try:
        frame = F.decode(raw)
    except PeerProtocolError:
        return
    assert F.encode(frame.message, frame.req) == raw


def mutate(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    op = rng.randrange(6)
    if op == 0 and data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif op == 1 and data:
        del data[rng.randrange(len(data)) :]
    elif op == 2:
        data += bytes(rng.randrange(1, 9))
    elif op == 3 and len(data) >= F.HEADER.size:  # a length field that lies
        struct.pack_into("<I", data, 8, rng.choice([0, len(data), 0xFFFFFFFF, rng.randrange(1 << 16)]))
    elif op == 4 and len(data) >= 4:
        data[3] = rng.randrange(256)  # another message type under the same body
    else:
        data[F.HEADER.size :] = rng.randbytes(rng.randrange(0, 80))
    return bytes(data)


def test_random_and_mutated_frames_decode_or_are_refused() -> None:
    rng = random.Random(SEED)
    valid = [F.encode(m, rng.randrange(1 << 32)) for m in SAMPLES]
    for _ in range(6000):
        raw = rng.randbytes(rng.randrange(0, 120)) if rng.random() < 0.2 else rng.choice(valid)
        for _ in range(rng.randrange(1, 4)):
            raw = mutate(rng, raw)
        check(raw)


def test_a_reader_fed_garbage_in_random_pieces_yields_frames_or_refuses() -> None:
    rng = random.Random(SEED + 1)
    valid = [F.encode(m, i) for i, m in enumerate(SAMPLES)]
    for _ in range(400):
        stream = b"".join(mutate(rng, rng.choice(valid)) if rng.random() < 0.3 else rng.choice(valid)
                          for _ in range(rng.randrange(1, 8)))
        reader = FrameReader()
        try:
            at = 0
            while at < len(stream):
                n = rng.randrange(1, 40)
                for frame in reader.feed(stream[at : at + n]):
                    assert F.encode(frame.message, frame.req) in stream
                at += n
        except PeerProtocolError:
            continue
        assert reader.buffered <= F.HEADER.size + F.MAX_BODY


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_refused(raw: bytes) -> None:
    check(raw)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=6))
def test_stacked_byte_changes_to_valid_frames(message: F.PeerMessage, changes: list[tuple[int, int]]) -> None:
    data = bytearray(F.encode(message, 1))
    for at, value in changes:
        if at < len(data):
            data[at] = value
    check(bytes(data))


def test_a_sealed_stream_with_any_change_yields_only_the_frames_before_it() -> None:
    """After the handshake (SPEC §8): a stream of sealed frames with bytes changed, dropped or inserted anywhere gives
    back, at most, the untouched frames before the change; nothing after it is ever decoded."""
    rng = random.Random(SEED + 2)
    key = rng.randbytes(32)
    for _ in range(300):
        sealer = F.Sealer(key)
        frames = [rng.choice(SAMPLES) for _ in range(rng.randrange(1, 6))]
        sealed = [sealer.seal(F.encode(m, i)) for i, m in enumerate(frames)]
        stream = bytearray(b"".join(sealed))
        at = rng.randrange(len(stream))
        how = rng.randrange(3)
        if how == 0:
            stream[at] ^= rng.randrange(1, 256)
        elif how == 1:
            del stream[at]
        else:
            stream.insert(at, rng.randrange(256))
        intact = 0  # frames wholly before the change
        while intact < len(sealed) and sum(map(len, sealed[: intact + 1])) <= at:
            intact += 1
        reader = FrameReader()
        reader.authenticate(key)
        got: list[F.Frame] = []
        try:
            for i in range(0, len(stream), 7):
                got += reader.feed(bytes(stream[i : i + 7]))
        except PeerProtocolError:
            pass
        assert got[:intact] == [F.Frame(i, m) for i, m in enumerate(frames[:intact])]
        assert len(got) <= intact, "a frame after the change was accepted"
