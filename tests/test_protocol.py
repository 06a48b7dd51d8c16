"""The broker wire codec on its own (SPEC §5: a versioned, length-prefixed binary format, encode/decode only).

No sockets here: `vmmshare.wire.local` does no I/O, so every rule of the format is checked on bytes, and the
decoder is fuzzed (it must only ever return a Frame or raise ProtocolError).
"""

from __future__ import annotations

import re
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vmmshare.wire import local as P
from vmmshare.wire.local import HEADER, LAYOUTS, MAGIC, MAX_BODY, MAX_FRAME, VERSION, Frame, Msg, ProtocolError, Tail

MiB2 = 2 << 20
U32_MAX = (1 << 32) - 1
REQUESTS = [m for m in Msg if m < 64]
REPLIES = [m for m in Msg if m >= 64]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- building frames by hand

_RANGES = {
    "b": (-(1 << 7), (1 << 7) - 1),
    "B": (0, (1 << 8) - 1),
    "h": (-(1 << 15), (1 << 15) - 1),
    "H": (0, (1 << 16) - 1),
    "i": (-(1 << 31), (1 << 31) - 1),
    "I": (0, U32_MAX),
    "q": (-(1 << 63), (1 << 63) - 1),
    "Q": (0, (1 << 64) - 1),
}


def fields(kind: Msg) -> list[tuple[str, int]]:
    """The fixed part of `kind` as (code, n): n ints for an int code, one n-byte string for 's'."""
    fmt = LAYOUTS[kind].fixed.format
    assert fmt[0] == "<", f"{kind.name}: the wire format is little-endian, got {fmt!r}"
    out = []
    for count, code in re.findall(r"(\d*)([a-zA-Z])", fmt[1:]):
        n = int(count or 1)
        if code == "s":
            out.append((code, n))
        else:
            assert code in _RANGES, f"{kind.name}: unexpected struct code {code!r}"
            out.extend((code, 1) for _ in range(n))
    return out


def msg(kind: Msg, *values: object, tail: object = b"") -> P.Message:
    """The message of type `kind` with these fixed values (and tail, for a type that has one)."""
    return LAYOUTS[kind].build(values, tail)


def tail_of(message: P.Message) -> object:
    """The tail field of a message whose type has one (b"" otherwise)."""
    layout = LAYOUTS[message.TYPE]
    return getattr(message, layout.tail_field) if layout.tail_field else b""


PROP_FIELDS = (0, 0, 5, 1, 0)  # handleType, allocationType, memAttr, location.type, location.id


def export_values(token: int = 3, size: int = MiB2, flags: int = 0, share_type: int = 1,
                  location_id: int = 0) -> tuple[int, ...]:
    """EXPORT's fixed fields: token, size, flags, share type, the exporter's server id, the memory kind
    (0: host memfd), then the five prop fields."""
    return (token, size, flags, share_type, 0x5E4F, 0, *PROP_FIELDS[:4], location_id)


def extreme_values(kind: Msg, high: bool) -> tuple[int | bytes, ...]:
    """The smallest or largest value of every fixed field."""
    out: list[int | bytes] = []
    for code, n in fields(kind):
        if code == "s":
            out.append(bytes([0xFF if high else 0]) * n)
        else:
            out.append(_RANGES[code][1 if high else 0])
    return tuple(out)


def full_tail(kind: Msg) -> bytes | str | tuple[int, ...]:
    """A tail exactly as long as `kind` allows."""
    layout = LAYOUTS[kind]
    if layout.tail is Tail.U32:
        return tuple(range(U32_MAX, U32_MAX - layout.max_tail // 4, -1))
    if layout.tail is Tail.TEXT:
        return "é" * (layout.max_tail // 2)
    if layout.tail is Tail.BYTES:
        return bytes(range(256)) * (layout.max_tail // 256) + bytes(range(layout.max_tail % 256))
    return b""


def decoded_tail(kind: Msg, tail: bytes | str | tuple[int, ...] | list[int]) -> bytes | str | tuple[int, ...]:
    """What decode gives back for a tail that encode was handed."""
    t = LAYOUTS[kind].tail
    if t is Tail.U32:
        return tuple(tail)  # type: ignore[arg-type]
    if t is Tail.TEXT:
        return tail if isinstance(tail, str) else bytes(tail).decode()  # type: ignore[arg-type]
    if t is Tail.BYTES:
        return bytes(tail)  # type: ignore[arg-type]
    return b""


def header(kind: int, length: int, req: int = 7, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    return HEADER.pack(magic, version, kind, req, length)


def raw_frame(kind: int, body: bytes, req: int = 7, **kw: object) -> bytes:
    """A frame with a consistent length field around an arbitrary body."""
    return header(kind, len(body), req, **kw) + body  # type: ignore[arg-type]


def assert_canonical(packet: bytes, nfds: int, frame: Frame) -> None:
    """A decoded frame re-encodes to exactly the packet it came from (decode is strict, so it is one-to-one)."""
    assert isinstance(frame, Frame)
    assert isinstance(frame.message, P.Message) and isinstance(frame.message.TYPE, Msg)
    assert nfds == LAYOUTS[frame.message.TYPE].fds
    again = P.encode(frame.message, frame.req)
    assert again == packet, f"{frame!r} re-encodes differently"


# ---------------------------------------------------------------- the format itself


def test_header_layout() -> None:
    assert HEADER.size == 12
    assert MAX_FRAME == 64 * 1024
    packet = P.encode(P.Charge(3, 5), 0x01020304)
    assert packet[:2] == b"VB"
    assert packet[2] == VERSION == 2
    assert packet[3] == Msg.CHARGE
    assert packet[4:8] == (0x01020304).to_bytes(4, "little")
    assert int.from_bytes(packet[8:12], "little") == len(packet) - 12 == 12
    assert packet[12:] == struct.pack("<iQ", 3, 5)


def test_message_numbers_are_stable() -> None:
    """Both ends of a socket may run different builds: the numbers are part of the format."""
    assert {m.name: int(m) for m in Msg} == {
        "CHARGE": 1, "RELEASE": 2, "MEM_INFO": 3, "EXPORT": 4, "REVOKE": 5, "SET_PIDS": 6, "IMPORT": 7,
        "BARE_TGID": 8, "LIST": 9, "CHARGE_GPU": 10, "OK": 64, "ERROR": 65, "TOKEN": 66, "MEM": 67, "EXPORTED": 68,
        "IMPORTED": 69, "PID": 70, "LISTING": 71, "REMOTE_IMPORT": 11, "SET_REMOTE_PIDS": 12, "REMOTE_IMPORTED": 72,
    }
    assert set(LAYOUTS) == set(Msg)
    assert all(layout.message.TYPE is kind for kind, layout in LAYOUTS.items())
    assert {m for m in Msg if LAYOUTS[m].fds} == {Msg.EXPORT, Msg.IMPORTED}
    assert all(LAYOUTS[m].fds <= P.MAX_FDS for m in Msg)


@pytest.mark.parametrize("kind", list(Msg), ids=lambda m: m.name)
@pytest.mark.parametrize("high", [False, True], ids=["min", "max"])
def test_round_trip_every_message_type(kind: Msg, high: bool) -> None:
    values = extreme_values(kind, high)
    req = U32_MAX if high else 0
    tail = full_tail(kind) if high else decoded_tail(kind, b"")
    packet = P.encode(msg(kind, *values, tail=tail), req)
    assert len(packet) <= MAX_FRAME
    frame = P.decode(packet, LAYOUTS[kind].fds)
    assert frame == Frame(req, msg(kind, *values, tail=decoded_tail(kind, tail)))
    assert P.peek_request_id(packet) == req
    ints = tuple(v for v in LAYOUTS[kind].values(frame.message) if isinstance(v, int))
    assert ints == tuple(v for v in values if isinstance(v, int))
    assert_canonical(packet, LAYOUTS[kind].fds, frame)


def test_round_trip_typical_requests() -> None:
    secret = bytes(range(32))
    cases = [
        (Msg.CHARGE, (-1, MiB2), b""),
        (Msg.EXPORT, export_values(5, MiB2, 1, 2, 3), (4, 5) if LAYOUTS[Msg.EXPORT].tail is Tail.U32 else b""),
        (Msg.SET_PIDS, (0xDEADBEEF, 1), (1, 2, 0x7FFFFFFF)),
        (Msg.IMPORT, (0xDEADBEEF, 2, secret), b""),
        (Msg.ERROR, (107017,), "handle 0x1 is unknown — révoqué"),
        (Msg.EXPORTED, (), b"VMMF" + bytes(124)),
        (Msg.LISTING, (), '{"exports": []}'),
    ]
    for kind, values, tail in cases:
        packet = P.encode(msg(kind, *values, tail=tail), 42)
        assert P.decode(packet, LAYOUTS[kind].fds) == Frame(42, msg(kind, *values, tail=decoded_tail(kind, tail)))


def test_largest_frame_is_accepted() -> None:
    """A LISTING may fill a frame to exactly MAX_FRAME; one byte more is refused."""
    text = "x" * MAX_BODY
    packet = P.encode(P.Listing(text), 1)
    assert len(packet) == MAX_FRAME
    assert P.decode(packet).message == P.Listing(text)
    with pytest.raises(ProtocolError):
        P.decode(raw_frame(Msg.LISTING, b"x" * (MAX_BODY + 1)))


# ---------------------------------------------------------------- each malformed case


def _set_pids(n_bytes_tail: bytes) -> bytes:
    return raw_frame(Msg.SET_PIDS, struct.pack("<QB", 9, 1) + n_bytes_tail)


GOOD_CHARGE = P.encode(P.Charge(0, MiB2), 7)
GOOD_EXPORT = P.encode(P.Export(*export_values()), 7)
GOOD_IMPORTED = P.encode(P.Imported(3, MiB2, 0, 0, 0, 5, 1, 0), 7)
GOOD_ERROR = P.encode(P.Error(107000, "bad"), 7)


def _with_length(packet: bytes, length: int) -> bytes:
    return packet[:8] + struct.pack("<I", length) + packet[12:]


# (id, a valid packet and its fd count, the malformed variant and its fd count): the valid one must decode,
# so each case shows that exactly the one thing it changes is what decode refuses.
MALFORMED = [
    ("empty", GOOD_CHARGE, 0, b"", 0),
    ("one_byte", GOOD_CHARGE, 0, b"V", 0),
    ("header_cut_short", GOOD_CHARGE, 0, GOOD_CHARGE[:11], 0),
    ("bad_magic", GOOD_CHARGE, 0, b"XB" + GOOD_CHARGE[2:], 0),
    ("magic_swapped", GOOD_CHARGE, 0, b"BV" + GOOD_CHARGE[2:], 0),
    ("version_0", GOOD_CHARGE, 0, GOOD_CHARGE[:2] + b"\x00" + GOOD_CHARGE[3:], 0),
    ("version_1", GOOD_CHARGE, 0, GOOD_CHARGE[:2] + b"\x01" + GOOD_CHARGE[3:], 0),
    ("version_255", GOOD_CHARGE, 0, GOOD_CHARGE[:2] + b"\xff" + GOOD_CHARGE[3:], 0),
    ("type_0", P.encode(P.Ok(), 7), 0, raw_frame(0, b""), 0),
    ("type_10", P.encode(P.Ok(), 7), 0, raw_frame(10, b""), 0),
    ("type_63", P.encode(P.Ok(), 7), 0, raw_frame(63, b""), 0),
    ("type_72", P.encode(P.Ok(), 7), 0, raw_frame(72, b""), 0),
    ("type_255", P.encode(P.Ok(), 7), 0, raw_frame(255, b""), 0),
    ("length_says_more", GOOD_CHARGE, 0, _with_length(GOOD_CHARGE, 13), 0),
    ("length_says_less", GOOD_CHARGE, 0, _with_length(GOOD_CHARGE, 11), 0),
    ("length_says_zero", GOOD_CHARGE, 0, _with_length(GOOD_CHARGE, 0), 0),
    ("length_says_u32_max", GOOD_CHARGE, 0, _with_length(GOOD_CHARGE, U32_MAX), 0),
    ("body_missing", GOOD_CHARGE, 0, GOOD_CHARGE[:12], 0),
    ("trailing_byte", GOOD_CHARGE, 0, raw_frame(Msg.CHARGE, GOOD_CHARGE[12:] + b"\0"), 0),
    ("trailing_byte_empty_body", P.encode(P.BareTgid(), 7), 0, raw_frame(Msg.BARE_TGID, b"\0"), 0),
    ("export_stray_byte", GOOD_EXPORT, 1, raw_frame(Msg.EXPORT, GOOD_EXPORT[12:] + b"\0"), 1),
    ("fixed_too_short", GOOD_CHARGE, 0, raw_frame(Msg.CHARGE, GOOD_CHARGE[12:-1]), 0),
    ("fixed_too_short_export", GOOD_EXPORT, 1, raw_frame(Msg.EXPORT, GOOD_EXPORT[12:-1]), 1),
    ("fixed_too_short_before_tail", _set_pids(b""), 0, raw_frame(Msg.SET_PIDS, struct.pack("<Q", 9)), 0),
    ("fixed_too_short_error", GOOD_ERROR, 0, raw_frame(Msg.ERROR, b"\0\0\0"), 0),
    ("u32_tail_5_bytes", _set_pids(bytes(8)), 0, _set_pids(bytes(5)), 0),
    ("u32_tail_3_bytes", _set_pids(b""), 0, _set_pids(bytes(3)), 0),
    ("text_invalid_utf8", GOOD_ERROR, 0, raw_frame(Msg.ERROR, GOOD_ERROR[12:16] + b"\xff\xfe"), 0),
    ("text_cut_mid_char", GOOD_ERROR, 0, raw_frame(Msg.ERROR, GOOD_ERROR[12:16] + "é".encode()[:1]), 0),
    ("text_surrogate", GOOD_ERROR, 0, raw_frame(Msg.ERROR, GOOD_ERROR[12:16] + b"\xed\xa0\x80"), 0),
    ("text_overlong", GOOD_ERROR, 0, raw_frame(Msg.ERROR, GOOD_ERROR[12:16] + b"\xc0\xaf"), 0),
    ("listing_invalid_utf8", P.encode(P.Listing("{}"), 7), 0, raw_frame(Msg.LISTING, b"{\x80}"), 0),
    ("bytes_tail_over_max", raw_frame(Msg.EXPORTED, bytes(128)), 0, raw_frame(Msg.EXPORTED, bytes(129)), 0),
    ("u32_tail_over_max", _set_pids(bytes(4096 * 4)), 0, _set_pids(bytes(4097 * 4)), 0),
    ("text_tail_over_max", raw_frame(Msg.ERROR, bytes(4) + b"a" * 4096), 0,
     raw_frame(Msg.ERROR, bytes(4) + b"a" * 4097), 0),
    ("export_without_fd", GOOD_EXPORT, 1, GOOD_EXPORT, 0),
    ("export_with_2_fds", GOOD_EXPORT, 1, GOOD_EXPORT, 2),
    ("export_with_3_fds", GOOD_EXPORT, 1, GOOD_EXPORT, 3),
    ("charge_with_fd", GOOD_CHARGE, 0, GOOD_CHARGE, 1),
    ("bare_tgid_with_fd", P.encode(P.BareTgid(), 7), 0, P.encode(P.BareTgid(), 7), 1),
    ("imported_without_fd", GOOD_IMPORTED, 1, GOOD_IMPORTED, 0),
    ("error_with_fd", GOOD_ERROR, 0, GOOD_ERROR, 1),
    ("frame_over_max", P.encode(P.Listing("x" * MAX_BODY), 7), 0,
     raw_frame(Msg.LISTING, b"x" * (MAX_BODY + 1)), 0),
    ("frame_far_over_max", P.encode(P.Listing("x" * MAX_BODY), 7), 0,
     raw_frame(Msg.LISTING, b"x" * (4 * MAX_FRAME)), 0),
    ("frame_over_max_bad_length", P.encode(P.Listing("x"), 7), 0,
     header(Msg.LISTING, 1) + b"x" * MAX_FRAME, 0),
]


@pytest.mark.parametrize(("good", "good_fds", "bad", "bad_fds"), [c[1:] for c in MALFORMED],
                         ids=[c[0] for c in MALFORMED])
def test_malformed_frame_raises_protocol_error(good: bytes, good_fds: int, bad: bytes, bad_fds: int) -> None:
    assert_canonical(good, good_fds, P.decode(good, good_fds))
    with pytest.raises(ProtocolError) as info:
        P.decode(bad, bad_fds)
    assert str(info.value).strip(), "a protocol error says what was wrong"


def test_protocol_error_is_a_value_error() -> None:
    """Callers that catch ValueError (or ProtocolError) around decode catch everything it raises."""
    assert issubclass(ProtocolError, ValueError)


def test_peek_request_id() -> None:
    assert P.peek_request_id(P.encode(P.BareTgid(), 0xCAFE)) == 0xCAFE
    assert P.peek_request_id(b"XXXX\x04\x03\x02\x01YYYY") == 0x01020304  # no need for the rest to parse
    assert P.peek_request_id(b"") == 0
    assert P.peek_request_id(b"VB\x02\x08\x05\x00\x00") == 0  # shorter than a header


# ---------------------------------------------------------------- encode refuses what does not fit


ENCODE_REFUSED = [
    ("charge_device_over_i32", Msg.CHARGE, (1 << 31, MiB2), b""),
    ("charge_device_under_i32", Msg.CHARGE, (-(1 << 31) - 1, MiB2), b""),
    ("charge_size_negative", Msg.CHARGE, (0, -1), b""),
    ("charge_size_over_u64", Msg.CHARGE, (0, 1 << 64), b""),
    ("release_negative_token", Msg.RELEASE, (-1,), b""),
    ("mem_info_negative_device", Msg.MEM_INFO, (-1,), b""),
    ("mem_info_over_u32", Msg.MEM_INFO, (1 << 32,), b""),
    ("export_flags_over_u8", Msg.EXPORT, export_values(flags=256), b""),
    ("export_share_type_negative", Msg.EXPORT, export_values(share_type=-1), b""),
    ("export_location_id_over_i32", Msg.EXPORT, export_values(location_id=1 << 31), b""),
    ("export_too_few_values", Msg.EXPORT, (3, MiB2, 0, 1), b""),
    ("charge_too_many_values", Msg.CHARGE, (0, MiB2, 1), b""),
    ("bare_tgid_with_a_value", Msg.BARE_TGID, (1,), b""),
    ("charge_no_values", Msg.CHARGE, (), b""),
    ("charge_str_value", Msg.CHARGE, ("0", MiB2), b""),
    ("charge_float_value", Msg.CHARGE, (0, 1.5), b""),
    ("charge_none_value", Msg.CHARGE, (None, MiB2), b""),
    ("import_secret_not_bytes", Msg.IMPORT, (1, 1, 5), b""),
    ("set_pids_negative_pid", Msg.SET_PIDS, (1, 1), (5, -1)),
    ("set_pids_pid_over_u32", Msg.SET_PIDS, (1, 1), (1 << 32,)),
    ("set_pids_pid_not_int", Msg.SET_PIDS, (1, 1), ("5",)),
    ("set_pids_4097_pids", Msg.SET_PIDS, (1, 1), tuple(range(1, 4098))),
    ("export_with_a_value_short", Msg.EXPORT, export_values()[:-1], b""),
    ("export_with_a_value_too_many", Msg.EXPORT, (*export_values(), 0), b""),
    ("exported_129_bytes", Msg.EXPORTED, (), bytes(129)),
    ("pid_negative", Msg.PID, (-5,), b""),
    ("mem_negative_free", Msg.MEM, (-1, 0), b""),
    ("error_text_none", Msg.ERROR, (107000,), None),
    ("error_text_int", Msg.ERROR, (107000,), 5),  # not five NULs
    ("error_text_negative", Msg.ERROR, (107000,), -1),
    ("listing_page_none", Msg.LISTING, (), None),
]


@pytest.mark.parametrize(("kind", "values", "tail"), [c[1:] for c in ENCODE_REFUSED],
                         ids=[c[0] for c in ENCODE_REFUSED])
def test_encode_refuses_values_that_do_not_fit(kind: Msg, values: tuple, tail: object) -> None:
    try:
        message = msg(kind, *values, tail=tail)
    except TypeError:  # the wrong number of values does not even make a message
        assert len(values) != len(LAYOUTS[kind].fields)
        return
    with pytest.raises(ProtocolError):
        P.encode(message, 1)


def test_encode_refuses_a_secret_longer_than_its_field() -> None:
    """IMPORT carries a 32-byte secret: 33 or 40 bytes do not fit (struct would silently cut them)."""
    assert P.decode(P.encode(P.Import(5, 2, bytes(range(32))), 1)).message == P.Import(5, 2, bytes(range(32)))
    for n in (33, 40):
        with pytest.raises(ProtocolError):
            P.encode(P.Import(5, 2, b"s" * n), 1)


@pytest.mark.parametrize(
    ("kind", "tail"),
    [
        (Msg.ERROR, "a" + "é" * 3000),  # the 4096-byte cut falls inside a two-byte character
        (Msg.ERROR, "ab" + "€" * 2000),  # ... inside a three-byte one
        (Msg.ERROR, "€" * 1365 + "😀"),  # ... inside a four-byte one
        (Msg.LISTING, "x" + "é" * (MAX_BODY // 2)),
    ],
    ids=["2byte", "3byte", "4byte", "listing"],
)
def test_long_text_is_cut_on_a_character_boundary(kind: Msg, tail: str) -> None:
    """An over-long TEXT tail is shortened, but what encode emits must still be a frame decode accepts."""
    layout = LAYOUTS[kind]
    assert len(tail.encode()) > layout.max_tail
    packet = P.encode(msg(kind, *extreme_values(kind, False), tail=tail), 9)
    text = tail_of(P.decode(packet).message)
    assert isinstance(text, str)
    assert tail.startswith(text)
    assert layout.max_tail - 4 < len(text.encode()) <= layout.max_tail


def test_encode_never_emits_text_that_decode_refuses() -> None:
    """A TEXT tail handed over as bytes that are not UTF-8: refused at encode, or sent as valid text."""
    try:
        packet = P.encode(P.Error(107000, b"\xff\xfe broken"), 1)  # type: ignore[arg-type]
    except ProtocolError:
        return
    frame = P.decode(packet)
    assert isinstance(frame.message, P.Error) and isinstance(frame.message.message, str)


# ---------------------------------------------------------------- property tests


def _fixed_strategy(kind: Msg) -> st.SearchStrategy[tuple[int | bytes, ...]]:
    parts: list[st.SearchStrategy[int | bytes]] = []
    for code, n in fields(kind):
        if code == "s":
            parts.append(st.binary(min_size=n, max_size=n))
        else:
            lo, hi = _RANGES[code]
            parts.append(st.integers(lo, hi))
    return st.tuples(*parts)


def _tail_strategy(kind: Msg) -> st.SearchStrategy[object]:
    layout = LAYOUTS[kind]
    if layout.tail is Tail.U32:
        return st.lists(st.integers(0, U32_MAX), max_size=min(layout.max_tail // 4, 64)).map(tuple)
    if layout.tail is Tail.TEXT:
        return st.text(max_size=min(layout.max_tail // 4, 300))
    if layout.tail is Tail.BYTES:
        return st.binary(max_size=layout.max_tail)
    return st.just(b"")


valid_frames = st.sampled_from(list(Msg)).flatmap(
    lambda kind: st.tuples(st.just(kind), st.integers(0, U32_MAX), _fixed_strategy(kind), _tail_strategy(kind))
)


@pytest.mark.slow
@FUZZ
@given(valid_frames)
def test_any_valid_frame_round_trips(parts: tuple) -> None:
    kind, req, values, tail = parts
    packet = P.encode(msg(kind, *values, tail=tail), req)
    assert len(packet) <= MAX_FRAME
    frame = P.decode(packet, LAYOUTS[kind].fds)
    assert frame == Frame(req, msg(kind, *values, tail=decoded_tail(kind, tail)))
    assert P.peek_request_id(packet) == req


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 4))
@example(b"", 0)
@example(GOOD_EXPORT, 1)
@example(P.encode(P.Listing("x" * MAX_BODY), 1), 0)
def test_decode_of_random_bytes_returns_a_frame_or_raises_protocol_error(packet: bytes, nfds: int) -> None:
    try:
        frame = P.decode(packet, nfds)
    except ProtocolError:
        return
    assert_canonical(packet, nfds, frame)


@FUZZ
@given(
    st.integers(0, 255), st.integers(0, 255), st.integers(0, U32_MAX), st.binary(max_size=120),
    st.integers(0, 3), st.booleans(),
)
def test_decode_of_random_bodies_behind_a_plausible_header(
    kind: int, version_noise: int, req: int, body: bytes, nfds: int, consistent: bool
) -> None:
    """Random type and body behind the right magic (and mostly the right version and length)."""
    version = VERSION if version_noise < 200 else version_noise
    length = len(body) if consistent else (len(body) + version_noise + 1) & U32_MAX
    packet = header(kind, length, req, version=version) + body
    try:
        frame = P.decode(packet, nfds)
    except ProtocolError:
        return
    assert frame.req == req
    assert_canonical(packet, nfds, frame)


@st.composite
def valid_packets(draw: st.DrawFn) -> tuple[bytes, int]:
    kind, req, values, tail = draw(valid_frames)
    return P.encode(msg(kind, *values, tail=tail), req), LAYOUTS[kind].fds


@FUZZ
@given(valid_packets(), st.data())
def test_one_mutated_byte_gives_a_frame_or_a_protocol_error(valid: tuple[bytes, int], data: st.DataObject) -> None:
    packet, nfds = valid
    at = data.draw(st.integers(0, len(packet) - 1), label="index")
    new = data.draw(st.integers(0, 255).filter(lambda b: b != packet[at]), label="byte")
    mutated = packet[:at] + bytes([new]) + packet[at + 1 :]
    if at in (0, 1, 2) or 8 <= at < 12:  # magic, version, length: always refused
        with pytest.raises(ProtocolError):
            P.decode(mutated, nfds)
        return
    try:
        frame = P.decode(mutated, nfds)
    except ProtocolError:
        return
    assert_canonical(mutated, nfds, frame)


@FUZZ
@given(valid_packets(), st.data())
def test_truncated_or_extended_valid_frame_is_refused(valid: tuple[bytes, int], data: st.DataObject) -> None:
    packet, nfds = valid
    cut = data.draw(st.integers(0, len(packet) - 1), label="keep")
    with pytest.raises(ProtocolError):
        P.decode(packet[:cut], nfds)
    extra = data.draw(st.binary(min_size=1, max_size=16), label="extra")
    with pytest.raises(ProtocolError):
        P.decode(packet + extra, nfds)


@FUZZ
@given(valid_packets(), st.integers(0, 4))
def test_wrong_fd_count_is_refused(valid: tuple[bytes, int], nfds: int) -> None:
    packet, right = valid
    if nfds == right:
        assert_canonical(packet, nfds, P.decode(packet, nfds))
    else:
        with pytest.raises(ProtocolError):
            P.decode(packet, nfds)


@FUZZ
@given(st.binary(max_size=40), st.integers(1, 4096))
def test_decode_refuses_any_packet_over_max_frame(start: bytes, over: int) -> None:
    packet = start + bytes(MAX_FRAME + over - len(start))
    with pytest.raises(ProtocolError):
        P.decode(packet)
    consistent = header(Msg.LISTING, len(packet) - HEADER.size) + packet[HEADER.size :]
    with pytest.raises(ProtocolError):
        P.decode(consistent)
