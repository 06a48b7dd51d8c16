"""The codec's shortcuts agree with its checked paths: a tailed frame decoded in one unpack, a frame encoded from its
values (`encode_fields`), and a DEFAULT handle built from the broker's bytes (`ShareableHandle.of`)."""

from __future__ import annotations

import pytest

from vmmshare.errors import AclError
from vmmshare.wire import local as P
from vmmshare.wire.handles import ShareableHandle, ShareType
from vmmshare.wire.local import LOCAL, ProtocolError

TAILED = [
    (P.Export(7, 2 << 20, 0, 1, 0, 0, 0, 0, 12, 1, 0, (11, 22, 33)), 1),
    (P.Export(7, 2 << 20, 1, 1, 0, 0, 0, 0, 12, 1, 0, ()), 1),
    (P.SetPids(0x1234, 1, (5,)), 0),
    (P.Error(107000, "bad thing: é"), 0),
    (P.Error(0, ""), 0),
    (P.Exported(b"\x01" * 8), 0),
    (P.Exported(b"\x02" * 128), 0),
    (P.Listing('{"a": 1}'), 0),
]


def _outcome(call, *args):  # type: ignore[no-untyped-def]
    try:
        return call(*args)
    except ProtocolError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize(("message", "nfds"), TAILED)
def test_tailed_frames_decode_as_the_checked_path_does(message: P.Message, nfds: int) -> None:
    frame = LOCAL.encode(message, 0x0A0B0C0D)
    assert LOCAL.decode(frame, nfds) == LOCAL._decode_checked(frame, nfds) == (0x0A0B0C0D, message)
    # broken versions of it: the same outcome (value or error message) either way
    length = int.from_bytes(frame[8:12], "little")

    def grown(extra: bytes) -> bytes:  # more tail, its header saying so (a ragged u32 tail, text that is not UTF-8)
        return frame[:8] + (length + len(extra)).to_bytes(4, "little") + frame[12:] + extra

    broken = [frame + b"\0", frame + b"\0" * 4, frame[:-1], frame[:12], b"VA" + frame[2:],
              frame[:2] + b"\2" + frame[3:],
              frame[:8] + (length + 4).to_bytes(4, "little") + frame[12:], frame + bytes(70000),
              grown(b"\xff"), grown(b"\xff" * 4), grown(bytes(200)), grown(bytes(5000))]
    for packet in broken:
        for fds in (0, 1, 2):
            assert _outcome(LOCAL.decode, packet, fds) == _outcome(LOCAL._decode_checked, packet, fds)


@pytest.mark.parametrize(("message", "nfds"), TAILED)
def test_encode_fields_makes_the_frame_encode_does(message: P.Message, nfds: int) -> None:
    layout = LOCAL.by_class[type(message)]
    assert LOCAL.encode_fields(layout, 99, layout.values(message), layout.tail_of(message)) == LOCAL.encode(message, 99)


def test_encode_fields_refuses_as_encode_does() -> None:
    layout = P.LAYOUTS[P.Msg.EXPORT]
    for values, tail in [((1 << 64, 1, 0, 1, 0, 0, 0, 0, 12, 1, 0), ()), ((7, 1, 0, 1, 0, 0, 0, 0, 12, 1, 0), (-1,)),
                         ((7, 1, 0, 1, 0, 0, 0, 0, 12, 1, 0), tuple(range(5000)))]:
        with pytest.raises(ProtocolError) as fields_error:
            LOCAL.encode_fields(layout, 1, values, tail)
        with pytest.raises(ProtocolError) as encode_error:
            LOCAL.encode(P.Export(*values, tail), 1)  # type: ignore[arg-type]
        assert str(fields_error.value) == str(encode_error.value)


@pytest.mark.parametrize("raw", [b"\x01" + bytes(7), bytes(range(1, 9)), b"\xff" * 8])
def test_default_handles_of_the_brokers_bytes_are_the_constructors(raw: bytes) -> None:
    made = ShareableHandle.of(ShareType.DEFAULT, raw)
    built = ShareableHandle("default", raw)
    assert made == built and str(made) == str(built) and int(made) == int(built)
    assert (made.kind, made.raw, made.share_type, made.value, made.fabric) == (
        built.kind, built.raw, built.share_type, built.value, built.fabric)
    assert made.share_type.label == "default" and ShareType.FABRIC.label == "fabric"


@pytest.mark.parametrize("raw", [bytes(8), b"\x01" * 7, b"\x01" * 9, bytearray(b"\x01" * 8), "12345678", None])
def test_bad_default_bytes_are_refused_as_the_constructor_refuses_them(raw: object) -> None:
    with pytest.raises(AclError) as of_error:
        ShareableHandle.of(ShareType.DEFAULT, raw)  # type: ignore[arg-type]
    with pytest.raises(AclError) as built_error:
        ShareableHandle("default", raw)  # type: ignore[arg-type]
    assert (type(of_error.value), str(of_error.value)) == (type(built_error.value), str(built_error.value))
