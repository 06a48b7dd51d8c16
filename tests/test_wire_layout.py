"""The broker wire format pinned byte for byte (SPEC §5): every message type, written out by hand from the format.

Brokers and clients of different builds talk over one socket, so the layout is a contract: these literals are
written from the format description (header: magic ``b"VB"``, version 1, type, request id, body length, all
little-endian), never computed from the codec's own tables. Each case is checked both ways: encoding the values
gives exactly the bytes, and decoding the bytes (with the number of fds the type carries) gives back the values.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from vmmshare.wire import local as P
from vmmshare.wire import peer as F
from vmmshare.wire.framing import PROP, cut_text
from vmmshare.wire.local import Frame, Msg, ProtocolError


def h(text: str) -> bytes:
    """Bytes from hex written with spaces between the fields."""
    return bytes.fromhex(text)


SECRET_HEX = "000102030405060708090a0b0c0d0e0f 101112131415161718191a1b1c1d1e1f"
FABRIC_HEX = "564d4d46" + " 00" * 124  # b"VMMF" and 124 zero bytes: 128 bytes in all

# (id, request id, message, fds it carries, the packet written out by hand)
CASES = [
    # ------------------------------------------------------------ requests
    ("charge_host", 0x01020304, P.Charge(device=-1, size=0x200000), 0,
     "5642 02 01 04030201 0c000000  ffffffff 0000200000000000"),
    ("charge_device_3", 7, P.Charge(device=3, size=0x4000000000), 0,
     "5642 02 01 07000000 0c000000  03000000 0000000040000000"),
    ("release", 9, P.Release(hold=0x1122334455667788), 0,
     "5642 02 02 09000000 08000000  8877665544332211"),
    ("mem_info", 10, P.MemInfo(device=7), 0,
     "5642 02 03 0a000000 04000000  07000000"),
    ("export_with_pids", 0x20,
     P.Export(hold=0x0102030405060708, size=0x400000, flags=1, share_type=2, server_id=0x5EED0001, memory_kind=0,
              handle_type=0, allocation_type=0, mem_attr=5, location_type=1, location_id=3, pids=(100, 0x12345678)),
     1,
     "5642 02 04 20000000 27000000  0807060504030201 0000400000000000 01 02 0100ed5e 00  00 00 05 01 03000000"
     "  64000000 78563412"),
    ("export_gpu_no_pids", 0x21,
     P.Export(hold=5, size=0x200000, flags=0, share_type=1, server_id=0, memory_kind=1, handle_type=0,
              allocation_type=0, mem_attr=5, location_type=1, location_id=-1, pids=()),
     1,
     "5642 02 04 21000000 1f000000  0500000000000000 0000200000000000 00 01 00000000 01  00 00 05 01 ffffffff"),
    ("revoke", 11, P.Revoke(hold=5), 0,
     "5642 02 05 0b000000 08000000  0500000000000000"),
    ("set_pids", 12, P.SetPids(shareable=0xDEADBEEFCAFEF00D, share_type=1, pids=(1, 0x7FFFFFFF, 0xFFFFFFFF)), 0,
     "5642 02 06 0c000000 15000000  0df0fecaefbeadde 01  01000000 ffffff7f ffffffff"),
    ("set_pids_empty", 13, P.SetPids(shareable=1, share_type=2, pids=()), 0,
     "5642 02 06 0d000000 09000000  0100000000000000 02"),
    ("import_fabric", 13, P.Import(shareable=0x8877665544332211, share_type=2, secret=bytes(range(32))), 0,
     "5642 02 07 0d000000 29000000  1122334455667788 02 " + SECRET_HEX),
    ("import_default", 0xFFFFFFFF, P.Import(shareable=0x10, share_type=1, secret=bytes(32)), 0,
     "5642 02 07 ffffffff 29000000  1000000000000000 01 " + "00" * 32),
    ("bare_tgid", 14, P.BareTgid(), 0,
     "5642 02 08 0e000000 00000000"),
    ("list", 15, P.List(offset=200), 0,
     "5642 02 09 0f000000 04000000  c8000000"),
    ("charge_gpu", 16, P.ChargeGpu(device=3, size=0x100000000), 0,
     "5642 02 0a 10000000 0c000000  03000000 0000000001000000"),
    ("remote_import", 25, P.RemoteImport(handle=b"VMMF" + bytes(124)), 0,
     "5642 02 0b 19000000 80000000  " + FABRIC_HEX),
    ("set_remote_pids", 26, P.SetRemotePids(shareable=0x0102030405060708, share_type=2, server=0x0A0B0C0D,
                                            pids=(7, 0x7FFFFFFF)), 0,
     "5642 02 0c 1a000000 15000000  0807060504030201 02 0d0c0b0a  07000000 ffffff7f"),
    # ------------------------------------------------------------ replies
    ("ok", 17, P.Ok(), 0,
     "5642 02 40 11000000 00000000"),
    ("error", 18, P.Error(code=107017, message="bad é"), 0,
     "5642 02 41 12000000 0a000000  09a20100 626164 20 c3a9"),
    ("error_no_message", 19, P.Error(code=507022, message=""), 0,
     "5642 02 41 13000000 04000000  8ebc0700"),
    ("token", 19, P.Token(hold=0x0102030405060708), 0,
     "5642 02 42 13000000 08000000  0807060504030201"),
    ("mem", 20, P.Mem(free=0x3FE00000, total=0x40000000), 0,
     "5642 02 43 14000000 10000000  0000e03f00000000 0000004000000000"),
    ("exported_default", 21, P.Exported(shareable=h("8877665544332211")), 0,
     "5642 02 44 15000000 08000000  8877665544332211"),
    ("exported_fabric", 22, P.Exported(shareable=b"VMMF" + bytes(124)), 0,
     "5642 02 44 16000000 80000000  " + FABRIC_HEX),
    ("imported", 0x16,
     P.Imported(hold=0x0A0B0C0D0E0F1011, size=0x200000, memory_kind=1, handle_type=0, allocation_type=0, mem_attr=5,
                location_type=1, location_id=2),
     1,
     "5642 02 45 16000000 19000000  11100f0e0d0c0b0a 0000200000000000 01  00 00 05 01 02000000"),
    ("pid", 23, P.Pid(pid=4242), 0,
     "5642 02 46 17000000 04000000  92100000"),
    ("listing", 24, P.Listing(page='{"next": null}'), 0,
     "5642 02 47 18000000 0e000000  7b226e657874223a206e756c6c7d"),
    ("remote_imported", 27,
     P.RemoteImported(hold=0x0102030405060708, size=0x200000, memory_kind=0, handle_type=0, allocation_type=0,
                      mem_attr=5, location_type=1, location_id=0, address=0x00007F1122334000, metadata_port=12345,
                      metadata_token=bytes(range(16)), data_port=0x4321, segment="vmmshare-0011223344556677"), 0,
     "5642 02 48 1b000000 4e000000  0807060504030201 0000200000000000 00  00 00 05 01 00000000 0040332211 7f0000"
     "  3930 000102030405060708090a0b0c0d0e0f 2143  766d6d73686172652d30303131323233333434353536363737"),
]

IDS = [c[0] for c in CASES]


def test_every_message_type_is_pinned() -> None:
    assert {c[2].TYPE for c in CASES} == set(Msg)


@pytest.mark.parametrize(("req", "message", "nfds", "packet"), [c[1:] for c in CASES], ids=IDS)
def test_encode_gives_exactly_these_bytes(req: int, message: P.Message, nfds: int, packet: str) -> None:
    assert P.encode(message, req) == h(packet)


@pytest.mark.parametrize(("req", "message", "nfds", "packet"), [c[1:] for c in CASES], ids=IDS)
def test_decode_gives_back_these_values(req: int, message: P.Message, nfds: int, packet: str) -> None:
    assert P.decode(h(packet), nfds) == Frame(req, message)


@pytest.mark.parametrize(("req", "message", "nfds", "packet"), [c[1:] for c in CASES], ids=IDS)
def test_the_fd_count_is_part_of_the_message(req: int, message: P.Message, nfds: int, packet: str) -> None:
    """EXPORT and IMPORTED carry exactly one fd; every other type none."""
    for wrong in {0, 1, 2} - {nfds}:
        with pytest.raises(ProtocolError):
            P.decode(h(packet), wrong)


def test_request_id_is_sent_modulo_2_to_the_32() -> None:
    assert P.encode(P.BareTgid(), 0x1_0000_0005) == h("5642 02 08 05000000 00000000")


def test_header_fields_one_by_one() -> None:
    """A LIST of offset 0x0a0b0c0d with request id 0x01020304: magic, version, type, request id, body length."""
    packet = P.encode(P.List(offset=0x0A0B0C0D), 0x01020304)
    assert packet[0:2] == b"VB"
    assert packet[2:3] == h("02")
    assert packet[3:4] == h("09")
    assert packet[4:8] == h("04030201")
    assert packet[8:12] == h("04000000")
    assert packet[12:] == h("0d0c0b0a")


# ---------------------------------------------------------------- both protocols, as they were written before

GOLDEN = json.loads((Path(__file__).parent / "wire_golden.json").read_text(encoding="utf-8"))["frames"]


def _golden_message(case: dict[str, Any]) -> Any:
    """The message a golden case names, of its protocol's module, with its recorded fields."""
    module = P if case["protocol"].startswith("local") else F
    return getattr(module, case["message"])(*ast.literal_eval(case["args"]))


def _matches(case: dict[str, Any], frame: bytes) -> bool:
    if "frame" in case:
        return frame.hex() == case["frame"]
    return len(frame) == case["length"] and hashlib.sha256(frame).hexdigest() == case["sha256"]


def test_golden_frames_cover_every_message_of_both_protocols() -> None:
    assert {c["message"] for c in GOLDEN if c["protocol"] == "local"} == {P.LAYOUTS[m].message.__name__ for m in Msg}
    assert {c["message"] for c in GOLDEN if c["protocol"] == "peer"} == {
        name.title().replace("_", "") for name in F.Kind.__members__}


@pytest.mark.parametrize("case", [c for c in GOLDEN if not c["protocol"].endswith("sealed")],
                         ids=lambda c: f"{c['protocol']}-{c['message']}")
def test_each_frame_encodes_to_the_recorded_bytes(case: dict[str, Any]) -> None:
    """Frames recorded from the codec before the two protocols shared one framing: the bytes did not move."""
    message = _golden_message(case)
    if case["protocol"].startswith("local"):
        frame = P.encode(message, case["req"])
        again = P.decode(frame, P.LAYOUTS[message.TYPE].fds).message
    else:
        frame = F.encode(message, case["req"])
        again = F.decode(frame).message
    assert _matches(case, frame), frame.hex()
    if "frame" in case:  # no text was cut: it decodes back to the message
        assert again == message


def test_sealed_peer_frames_are_the_recorded_bytes() -> None:
    """The MAC of each frame after the handshake: same key, same sequence, same bytes."""
    sealer = F.Sealer(bytes(range(32)))
    reader = F.FrameReader()
    reader.authenticate(bytes(range(32)))
    for case in (c for c in GOLDEN if c["protocol"] == "peer-sealed"):
        message = _golden_message(case)
        sealed = sealer.seal(F.encode(message, case["req"]))
        assert _matches(case, sealed), sealed.hex()
        assert reader.feed(sealed) == [F.Frame(case["req"], message)]


def test_the_allocation_property_is_one_codec_in_every_message_that_carries_it() -> None:
    """EXPORT, IMPORTED, REMOTE_IMPORTED and the peer's IMPORTED carry the five prop fields, in one order and code."""
    carriers = [P.LAYOUTS[Msg.EXPORT], P.LAYOUTS[Msg.IMPORTED], P.LAYOUTS[Msg.REMOTE_IMPORTED],
                F.LAYOUTS[F.Kind.IMPORTED]]
    for layout in carriers:
        at = layout.fields.index(PROP.fields[0])
        assert layout.fields[at : at + 5] == PROP.fields, layout.name
        assert PROP.format in layout.fixed.format, layout.name
    prop = (2, 0, 5, 1, -3)
    local = P.Imported(1, 2, 0, *prop)
    peer = F.Imported(1, 2, 0, *prop, 0x1000, "10.0.0.1:1")
    assert PROP.values(local) == PROP.values(peer) == prop
    assert PROP.values(P.decode(P.encode(local, 1), 1).message) == prop
    assert PROP.values(F.decode(F.encode(peer, 1)).message) == prop


def test_text_is_cut_by_one_rule_on_both_wires() -> None:
    """An over-long error text is cut on a UTF-8 boundary by both protocols; a peer segment name is refused, not cut."""
    for text in ("a" + "é" * 3000, "€" * 2000, "😀" * 1200):
        local = P.decode(P.encode(P.Error(1, text), 1)).message
        peer = F.decode(F.encode(F.Error(1, text), 1)).message
        assert isinstance(local, P.Error) and isinstance(peer, F.Error)
        assert local.message.encode() == cut_text(text.encode(), 4096)
        assert peer.message.encode() == cut_text(text.encode(), F.MAX_TEXT)
        assert text.startswith(local.message) and text.startswith(peer.message)
    assert cut_text("é".encode() * 3, 5) == "é".encode() * 2
    assert cut_text(b"abc", 3) == b"abc"
    with pytest.raises(F.PeerProtocolError):
        F.encode(F.Imported(1, 1, 0, 0, 0, 5, 1, 0, 0, "é" * 128), 1)
