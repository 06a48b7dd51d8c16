"""Protocol fuzzing, CI-sized (the full run is ``stress/fuzz_protocol.py``; numbers in docs/reliability.md §1).

- the decoder alone on 5,000 random and mutated frames of every message type: a Frame that re-encodes to the
  same bytes, or a ProtocolError, nothing else;
- a coverage-guided atheris run when atheris is installed (skipped otherwise);
- 1,000 of the same frames sent to a live broker over several connections, some with real fds: every packet is
  answered as the protocol says, and afterwards the broker is alive, serves a real export/import round trip,
  holds no fd it was handed, and its fd count and RSS are back at baseline;
- hypothesis: stacked mutations of valid frames (test_protocol.py mutates one byte at a time), and a stateful
  model of the broker's capacity and export tables driven by valid and malformed frames on several connections.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import fuzz_frames as G
import fuzz_live as L
import fuzz_protocol as F
import rawsock
from vmmshare.wire import local as P
from vmmshare.wire.local import LAYOUTS, Frame, Msg, ProtocolError

SEED = 20251201  # a seed whose live run reaches imports (the mix of message types decides it)
DECODER_FRAMES = 5_000
LIVE_FRAMES = 1_000
CAPACITY = 64 << 20
MiB2 = 2 << 20


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[L.Broker]:
    b = L.Broker(tmp_path, env={"VMMSHARE_DEVICE_MEMORY": str(CAPACITY)})
    try:
        yield b
    finally:
        b.stop()


# ---------------------------------------------------------------- the generator itself


def test_generator_is_deterministic_and_covers_every_type_and_mutation() -> None:
    """The same seed gives the same frames (so a failure reproduces), and the mix reaches every type and op."""
    first = [(c.packet, c.nfds) for c in G.generate(SEED, 2_000)]
    assert first == [(c.packet, c.nfds) for c in G.generate(SEED, 2_000)]
    assert first != [(c.packet, c.nfds) for c in G.generate(SEED + 1, 2_000)]
    cases = list(G.generate(SEED, 2_000))
    assert {c.kind for c in cases if c.origin in ("valid", "mutated")} == {int(m) for m in Msg}
    assert {op for c in cases for op in c.ops} == set(G.MUTATIONS)
    assert {c.origin for c in cases} == {"valid", "mutated", "random", "header+random"}
    for c in cases:
        if c.origin == "valid":
            assert F.check_decode(c)[0] == "ok", c


# ---------------------------------------------------------------- (a) the decoder alone


def test_decoder_returns_a_frame_or_a_protocol_error() -> None:
    result = F.fuzz_decoder(SEED, DECODER_FRAMES)
    assert result["frames"] == DECODER_FRAMES
    assert result["defects"] == 0, result["defect_samples"][:5]
    assert result["decoded_ok"] + result["refused"] == DECODER_FRAMES
    # the mix tests both sides: plenty of each outcome, every type decoded, many different refusals
    assert result["decoded_ok"] > DECODER_FRAMES // 10
    assert result["refused"] > DECODER_FRAMES // 2
    assert set(result["decoded_by_type"]) == {m.name for m in Msg}
    assert result["distinct_error_templates"] >= 30, result["top_error_templates"]
    assert result["by_origin"].get("mutated:ok", 0) > 0, "no mutation survived: the decoder is not reached deeply"


def test_check_decode_reports_an_escaping_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """A positive control: the harness does see a decoder that raises something other than ProtocolError."""
    case = next(c for c in G.generate(SEED, 100) if c.origin == "valid")

    def broken(packet: bytes, nfds: int = 0) -> Frame:
        raise IndexError("boom")

    monkeypatch.setattr(P, "decode", broken)
    status, _, message = F.check_decode(case)
    assert status == "defect" and "IndexError" in message


def test_atheris_coverage_guided() -> None:
    pytest.importorskip("atheris")
    result = F.fuzz_atheris(3_000, SEED, 60)
    assert result["available"]
    assert result["ok"], result["tail"]
    assert result["execs"] == 3_000
    assert result["coverage_edges"] and result["coverage_edges"] > 20, "atheris did not see the decoder's coverage"


# ---------------------------------------------------------------- (b) a live broker


def test_live_broker_survives_the_fuzz_frames(broker: L.Broker) -> None:
    result = L.fuzz_live(broker, SEED, LIVE_FRAMES, connections=6, scripted_rate=0.1)
    assert result["frames_sent"] == LIVE_FRAMES
    assert result["defects"] == 0, result["defect_samples"][:5]
    assert result["broker_alive"]
    assert result["round_trip"] == "ok"
    assert result["broker_fd_after"] == result["broker_fd_baseline"]
    assert result["broker_fd_after_round_trip"] == result["broker_fd_baseline"]
    assert result["pipe_fds_still_held"] == 0
    assert result["state_after"]["all_free"] and result["state_after"]["exports"] == 0
    assert result["broker_rss_kb_after"] - result["broker_rss_kb_before"] < L.RSS_LIMIT_KB
    assert 507000 not in result["error_codes"], result["internal_error_messages"]
    assert result["broker_log_tracebacks"] == 0, result.get("broker_log_tail")
    # the run exercised what it claims to: refusals, real replies, fds, several connections
    assert result["error_codes"].get(507022, 0) > LIVE_FRAMES // 2
    assert len(result["replies"]) >= 4, result["replies"]
    assert result["frames_with_fds"] > 50
    assert result["fd_kinds"].keys() == {"pipe", "memfd", "devnull"}
    assert result["exports_made"] > 0 and result["imports_made"] > 0, "the broker's sharing paths were not reached"


def test_live_harness_flags_a_wrong_reply(broker: L.Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A positive control: with 107017 no longer an accepted refusal, the same traffic must show defects."""
    monkeypatch.setattr(L, "REQUEST_ERRORS", L.REQUEST_ERRORS - {107017})
    result = L.fuzz_live(broker, SEED, 300, connections=3, scripted_rate=0.1)
    assert result["defects"] > 0
    assert any("unexpected code 107017" in d["what"] for d in result["defect_samples"])


# ---------------------------------------------------------------- hypothesis: stacked mutations


@st.composite
def mutated_packets(draw: st.DrawFn) -> tuple[bytes, int, list[str]]:
    kind = draw(st.sampled_from(list(Msg)))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    packet, nfds = G.valid_frame(rng, kind)
    ops = draw(st.lists(st.sampled_from(list(G.MUTATIONS)), min_size=1, max_size=6))
    p = bytearray(packet)
    for op in ops:
        nfds = G.MUTATIONS[op](rng, p, nfds)
    if draw(st.booleans()):
        G._fix_length(p)
    return bytes(p), nfds, ops


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_packets())
def test_stacked_mutations_give_a_canonical_frame_or_a_protocol_error(case: tuple[bytes, int, list[str]]) -> None:
    packet, nfds, ops = case
    try:
        frame = P.decode(packet, nfds)
    except ProtocolError as exc:
        assert str(exc).strip()
        return
    assert isinstance(frame, Frame) and nfds == LAYOUTS[frame.message.TYPE].fds
    assert P.encode(frame.message, frame.req) == packet, ops


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(Msg)), st.sampled_from(list(Msg)), st.integers(0, 2**32 - 1))
def test_type_confusion_body_of_one_type_under_another(built: Msg, claimed: Msg, seed: int) -> None:
    """A valid body of one type behind the header of another: refused, or decoded as the claimed type, canonically."""
    packet, _ = G.valid_frame(random.Random(seed), built)
    confused = packet[:3] + bytes([claimed]) + packet[4:]
    try:
        frame = P.decode(confused, LAYOUTS[claimed].fds)
    except ProtocolError:
        return
    assert frame.message.TYPE is claimed
    assert P.encode(frame.message, frame.req) == confused


# ---------------------------------------------------------------- hypothesis: a stateful model of the broker


def test_broker_state_matches_a_model_under_mixed_traffic(broker: L.Broker) -> None:
    """Charges, releases, exports and malformed frames on up to three connections, closing and reopening them:
    after every step the broker's free capacity and export list equal what a model of the rules predicts."""
    devices = 8
    baseline = L.settled_fd_count(broker)

    class Model(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.conns: list[L.Conn] = [L.Conn(broker.socket)]
            self.charged: dict[L.Conn, dict[int, tuple[int, int]]] = {self.conns[0]: {}}  # token -> (device, size)
            self.exported: dict[L.Conn, set[int]] = {self.conns[0]: set()}

        def teardown(self) -> None:
            for c in self.conns:
                c.close()

        def _used(self, device: int) -> int:
            return sum(s for tokens in self.charged.values() for d, s in tokens.values() if d == device)

        @precondition(lambda self: len(self.conns) < 3)
        @rule()
        def open_conn(self) -> None:
            c = L.Conn(broker.socket)
            self.conns.append(c)
            self.charged[c], self.exported[c] = {}, set()

        @precondition(lambda self: len(self.conns) > 1)
        @rule(i=st.integers(0, 2))
        def close_conn(self, i: int) -> None:
            c = self.conns.pop(i % len(self.conns))
            event("close with an export" if self.exported[c] else "close")
            c.close()  # the broker releases everything the connection held and revokes its exports
            del self.charged[c], self.exported[c]

        @rule(i=st.integers(0, 2), device=st.sampled_from([0, 1, 0, 1, 7, -1, -1, -2, devices, 2**31 - 1]),
              size=st.sampled_from([MiB2, MiB2, 4 * MiB2, 4 * MiB2, CAPACITY // 2, CAPACITY, CAPACITY + 1, 2**63]))
        def charge(self, i: int, device: int, size: int) -> None:
            c = self.conns[i % len(self.conns)]
            reply = c.call(P.Charge(device, size))
            if device != -1 and not 0 <= device < devices:
                assert isinstance(reply, P.Error) and reply.code == 107001, reply
            elif device >= 0 and self._used(device) + size > CAPACITY:
                assert isinstance(reply, P.Error) and reply.code == 207001, reply
            else:
                assert isinstance(reply, P.Token), reply
                self.charged[c][reply.hold] = (device, size)

        @rule(i=st.integers(0, 2), j=st.integers(0, 2), pick=st.integers(0, 1 << 16))
        def release(self, i: int, j: int, pick: int) -> None:
            """Release a token of this connection or of another one (refused: tokens belong to their connection)."""
            c, owner = self.conns[i % len(self.conns)], self.conns[j % len(self.conns)]
            tokens = sorted(self.charged[owner])
            token = tokens[pick % len(tokens)] if tokens else pick
            reply = c.call(P.Release(token))
            if owner is c and token in self.charged[c]:
                assert isinstance(reply, P.Ok), reply
                del self.charged[c][token]
                event("release of an exported token" if token in self.exported[c] else "release")
                self.exported[c].discard(token)
            else:
                assert isinstance(reply, P.Error) and reply.code == 107017, reply

        @rule(i=st.integers(0, 2), pick=st.integers(0, 1 << 16), right_size=st.sampled_from([True, True, False]),
              flags=st.sampled_from([0, 1, 0, 1, 2]), share_type=st.sampled_from([1, 2, 1, 2, 0, 3]))
        def export(self, i: int, pick: int, right_size: bool, flags: int, share_type: int) -> None:
            c = self.conns[i % len(self.conns)]
            tokens = sorted(self.charged[c])
            if not tokens:
                return
            token = tokens[pick % len(tokens)]
            size = self.charged[c][token][1]
            if size > CAPACITY:
                return  # host charges of 2**63 bytes: no memfd of that size
            fd = rawsock.sealed_memfd(size if right_size else size + 4096, "model")
            try:
                reply = c.call(P.Export(token, size, flags, share_type, 0, 0, 0, 0, 5, 1, 0), fds=(fd,))
            finally:
                os.close(fd)
            if token in self.exported[c] or flags > 1 or share_type not in (1, 2) or not right_size:
                assert isinstance(reply, P.Error) and reply.code == 107000, reply
            else:
                assert isinstance(reply, P.Exported) and len(reply.shareable) == (8 if share_type == 1 else 128), reply
                self.exported[c].add(token)
                event("export")

        @rule(i=st.integers(0, 2), case=mutated_packets())
        def garbage(self, i: int, case: tuple[bytes, int, list[str]]) -> None:
            """A mutated frame (fd count as a claim only: sent without fds). Refused frames change nothing."""
            packet, _, _ = case
            try:
                frame = P.decode(packet, 0)
            except ProtocolError:
                frame = None
            if frame is not None or not packet:
                return  # a valid request would change the model; an empty record closes the connection
            c = self.conns[i % len(self.conns)]
            assert c.send(packet, [])
            data, got, _ = c.recv()
            assert data is not None and not got
            frame = P.decode(data, 0)
            assert isinstance(frame.message, P.Error) and frame.message.code == L.IPC_ERROR, frame
            assert frame.req == P.peek_request_id(packet)

        @invariant()
        def broker_agrees_with_the_model(self) -> None:
            # A fresh connection is the barrier: its first request is served in a select pass after the one that
            # accepted it, which saw every close made before the connect. (A long-lived connection is not: the
            # broker serves up to 64 of its queued requests before turning to the other ready connections.)
            observer = L.Conn(broker.socket)
            try:
                for d in range(devices):
                    reply = observer.call(P.MemInfo(d))
                    assert reply == P.Mem(CAPACITY - self._used(d), CAPACITY), (d, reply)
                exports = json.loads(observer.call(P.List(0)).page)["exports"]
                assert len(exports) == sum(len(e) for e in self.exported.values())
            finally:
                observer.close()

    run_state_machine_as_test(
        Model, settings=settings(max_examples=30, stateful_step_count=25, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])
    )
    assert L.broker_state(broker) == {"all_free": True, "exports": 0, "clients_seen": 1}
    assert L.settled_fd_count(broker) == baseline, "closed model connections left fds in the broker"
