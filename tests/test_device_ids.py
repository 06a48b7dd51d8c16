"""Device ids (SPEC §2): user ids after ASCEND_RT_VISIBLE_DEVICES, the node's logical and physical ids, the four
conversions and device_get_uuid, with the runtime's codes (api_c_device.cc, api_error.cc, runtime.cc).

Each test runs real processes on its own broker, so that a device's capacity is seen node-wide.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from procs import PROP, Actor, BrokerProc, MiB2, fails, ok
from vmmshare.runtime.devices import parse_visible

PARAM, BAD_DEVICE, NO_DEVICE = 107000, 107001, 207004
DEFAULT = 1
CONVERSIONS = ("rt.get_logic_dev_id_by_user_dev_id", "rt.get_user_dev_id_by_logic_dev_id",
               "rt.get_logic_dev_id_by_phy_dev_id", "rt.get_phy_dev_id_by_logic_dev_id")
MakeActor = Callable[..., Actor]


@pytest.fixture(params=["python", "c"])
def actor(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MakeActor]:
    """Actors on a broker of their own, on each surface in turn: vmmshare.acl, and the C library through `cacl`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VMMSHARE_", "ASCEND_RT_"))}
    env["VMMSHARE_DEVICES"] = "8"
    env["VMMSHARE_ACTOR_SURFACE"] = request.param
    broker = BrokerProc(tmp_path, env=env)
    made: list[Actor] = []

    def make(visible: str | None = None, device: int | None = 0, **extra: str) -> Actor:
        e = {**broker.env, **extra}
        if visible is not None:
            e["ASCEND_RT_VISIBLE_DEVICES"] = visible
        a = Actor(e, device=device)
        made.append(a)
        return a

    yield make
    for a in made:
        a.kill()
    broker.kill()


# ---------------------------------------------------------------- how the runtime reads the variable


@pytest.mark.parametrize(("text", "ids", "error"), [
    (None, None, ""),
    ("1", [1], ""),
    ("1,2,3", [1, 2, 3], ""),
    ("0,7", [0, 7], ""),
    ("007", [7], ""),
    ("1, 2,3", [1], ""),  # a space ends the list (the runtime's documented example)
    ("1,3,8", [1, 3], ""),  # 8 is not a device of 8: the list ends before it (ditto)
    ("1,,2", [1], ""),  # two commas in a row end it
    ("2,x", [2], ""),
    ("0,1,2,3,4,5,6,7,0", list(range(8)), ""),  # as many as there are devices, then it stops reading
    ("1,2" + "," * 200 + "3", [1, 2], ""),
    ("", [], "no device"),
    (" 1", [], "no device"),
    ("a", [], "no device"),
    ("8", [], "no device"),
    ("99999999999999999999", [], "no device"),
    ("3,2", [], "ascending"),
    ("1,1", [], "duplicated"),
    ("1,2,2", [], "duplicated"),
])
def test_visible_devices_are_parsed_as_the_runtime_parses_them(text: str | None, ids: list[int] | None,
                                                                error: str) -> None:
    got, why = parse_visible(text, 8)
    assert got == ids
    assert (error in why) if error else why == ""


# ---------------------------------------------------------------- user ids in the device calls


def test_visible_devices_renumber_the_devices_a_process_sees(actor: MakeActor) -> None:
    """ASCEND_RT_VISIBLE_DEVICES=2,3: two devices, 0 and 1, which are the node's 2 and 3; memory allocated on
    user device 1 is charged to node device 3, as a process without the variable sees it."""
    seen, plain = actor("2,3"), actor(device=3)
    assert ok(seen, "rt.get_device_count") == 2
    assert ok(plain, "rt.get_device_count") == 8
    ok(seen, "rt.set_device", 1)
    assert ok(seen, "rt.get_device") == 1
    assert "ASCEND_RT_VISIBLE_DEVICES" in fails(seen, BAD_DEVICE, "rt.set_device", 2)
    free_before = ok(plain, "rt.get_mem_info", 0)[0]
    h = ok(seen, "rt.malloc_physical", MiB2, {**PROP, "location": {"id": 1, "type": 1}}, 0)
    assert ok(plain, "rt.get_mem_info", 0)[0] == free_before - MiB2, "user device 1 is not node device 3"
    fails(seen, BAD_DEVICE, "rt.malloc_physical", MiB2, {**PROP, "location": {"id": 2, "type": 1}}, 0)
    ok(seen, "rt.free_physical", h)
    assert ok(plain, "rt.get_mem_info", 0)[0] == free_before


def test_the_four_conversions(actor: MakeActor) -> None:
    """user -> logic and back through the visible list; physical ids are the node's device numbers, and the
    runtime's phy calls take and give the index the process sees (GetDevicePhyIdByIndex / GetDeviceIndexByPhyId
    in api_error.cc convert it as a user id)."""
    a = actor("1,4,6", device=None)
    logic_of_user, user_of_logic, logic_of_phy, phy_of_logic = CONVERSIONS
    assert [ok(a, logic_of_user, u) for u in range(3)] == [1, 4, 6]
    assert [ok(a, user_of_logic, n) for n in (1, 4, 6)] == [0, 1, 2]
    assert [ok(a, phy_of_logic, u) for u in range(3)] == [1, 4, 6]
    assert [ok(a, logic_of_phy, n) for n in (1, 4, 6)] == [0, 1, 2]
    fails(a, BAD_DEVICE, logic_of_user, 3)  # beyond the visible ones
    fails(a, BAD_DEVICE, user_of_logic, 2)  # a node device this process does not see
    fails(a, BAD_DEVICE, user_of_logic, 8)  # not a device of the node
    fails(a, BAD_DEVICE, logic_of_phy, 5)
    fails(a, BAD_DEVICE, phy_of_logic, 3)
    for name in CONVERSIONS:
        assert ok(a, name, 1) >= 0
        fails(a, PARAM, name, -1)  # the rts layer's own check (api_c_device.cc)
        fails(a, PARAM, name, "0")
        fails(a, PARAM, name, 1 << 31)
    b = actor(device=None)  # no variable: every id is the node's
    for name in CONVERSIONS:
        assert [ok(b, name, d) for d in range(8)] == list(range(8))
        assert "8" in fails(b, BAD_DEVICE, name, 8)


def test_an_invalid_variable_leaves_the_process_without_devices(actor: MakeActor) -> None:
    for text in ("3,1", "1,1", "x", ""):
        a = actor(text, device=None)
        msg = fails(a, NO_DEVICE, "rt.get_device_count")
        assert "ASCEND_RT_VISIBLE_DEVICES" in msg
        assert "ASCEND_RT_VISIBLE_DEVICES" in fails(a, BAD_DEVICE, "rt.set_device", 0)
        fails(a, BAD_DEVICE, "rt.get_logic_dev_id_by_user_dev_id", 0)
        fails(a, BAD_DEVICE, "rt.device_get_uuid", 0)


# ---------------------------------------------------------------- device_get_uuid


def test_device_uuid_is_16_bytes_stable_per_server_and_device(actor: MakeActor) -> None:
    a, b, seen = actor(device=None), actor(device=None), actor("2,3", device=None)
    other_server = actor(device=None, VMMSHARE_SERVER_ID="0x77")
    ids = [ok(a, "rt.device_get_uuid", d) for d in range(8)]
    assert all(isinstance(u, bytes) and len(u) == 16 for u in ids)
    assert len(set(ids)) == 8, "two devices share a uuid"
    assert [ok(b, "rt.device_get_uuid", d) for d in range(8)] == ids, "another process sees other uuids"
    assert ok(seen, "rt.device_get_uuid", 0) == ids[2], "the uuid follows the node's device, not the user id"
    assert ok(seen, "rt.device_get_uuid", 1) == ids[3]
    assert ok(other_server, "rt.device_get_uuid", 0) != ids[0], "another server's device 0 has the same uuid"
    for bad in (8, -1):
        fails(a, BAD_DEVICE, "rt.device_get_uuid", bad)
    fails(seen, BAD_DEVICE, "rt.device_get_uuid", 2)
    result = a.call("rt.device_get_uuid", 99)
    assert result == (None, BAD_DEVICE)


def test_a_visible_device_imports_onto_the_node_device(actor: MakeActor) -> None:
    """An import in a process with ASCEND_RT_VISIBLE_DEVICES lands on its current (user) device, and the
    exporter's memory is the same bytes."""
    e, i = actor(device=5), actor("5", device=0)
    h = ok(e, "rt.malloc_physical", MiB2, {**PROP, "location": {"id": 5, "type": 1}}, 0)
    p = ok(e, "rt.reserve_mem_address", MiB2, 0, 0, 0)
    ok(e, "rt.map_mem", p, MiB2, 0, h, 0)
    e.call("!write_bytes", p, b"on node device 5")
    s = ok(e, "rt.mem_export_to_shareable_handle_v2", h, 1, DEFAULT)
    ih = ok(i, "rt.mem_import_from_shareable_handle_v2", s, DEFAULT, 0)
    assert ok(i, "rt.mem_get_allocation_properties_from_handle", ih)["location"] == {"id": 0, "type": 1}
    q = ok(i, "rt.reserve_mem_address", MiB2, 0, 0, 0)
    ok(i, "rt.map_mem", q, MiB2, 0, ih, 0)
    assert i.call("!read", q, 16) == b"on node device 5"
