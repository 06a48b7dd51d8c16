#!/usr/bin/env python3
"""Protocol fuzzing: the broker wire codec on its own, then (``--live``) the same frames against a live broker.

(a) Decoder: random frames and mutations of valid frames of every message type in ``protocol.LAYOUTS`` (bit flips,
    byte changes, insertions and deletions, truncation, extension, header field changes, type confusion, random
    fd counts) go through ``protocol.decode``. The only outcomes allowed are a ``Frame`` (which must re-encode to
    exactly the packet it came from) or a ``ProtocolError``. When ``atheris`` imports, a coverage-guided run of
    libFuzzer over the same decoder follows, in a child process (libFuzzer ends its process when it is done).
(b) ``--live``: the same frames (the first ``--live-frames`` of the sequence) are sent to a broker started for
    the run, over several connections, some with real fds attached (pipe ends, memfds, /dev/null). Every packet
    must get a reply addressed to its request id (an ERROR 507022 for every packet the codec refuses, a documented
    reply or error for the valid ones) or, for an empty packet, a closed connection. Afterwards the broker must be
    alive, serve a real allocate/export/import round trip between two processes, hold no fd it was handed, have
    its fd count back at baseline and its RSS within 5 MiB of baseline.

    vmmshare stress fuzz_protocol --frames 100000 --live --json out.json

Exit status 0 when every invariant held, 1 otherwise. Loops are bounded by count and by ``--seconds``. The frames
and their mutations are fuzz_frames.py's; the live run is fuzz_live.py's; this module is the decoder's fuzzing and
the command.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from vmmshare.wire import local as P
from vmmshare.wire.local import LAYOUTS, Frame, Msg, ProtocolError

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from fuzz_frames import KINDS, Case, generate, valid_frame  # noqa: E402
from fuzz_live import Broker, fuzz_live  # noqa: E402
from stressio import count_option, emit, entry, fraction, prog, readable, seconds_option, whole  # noqa: E402
from vmmshare.cli.console import NarrowHelp, check_outputs  # noqa: E402

# ---------------------------------------------------------------- (a) the decoder alone


def _template(message: str) -> str:
    """A ProtocolError message with its numbers and quoted bytes taken out, to count kinds of refusal."""
    message = re.sub(r"b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\"", "B", message)
    message = re.sub(r"0x[0-9a-fA-F]+|\d+", "N", message)
    return re.sub(r"(can't decode byte|invalid (?:start|continuation) byte|unexpected end of data).*",
                  r"\1 …", message)


def check_decode(case: Case) -> tuple[str, Frame | None, str]:
    """('ok', frame, '') | ('refused', None, message) | ('defect', None, what went wrong)."""
    try:
        frame = P.decode(case.packet, case.nfds)
    except ProtocolError as exc:
        message = str(exc)
        if not message.strip():
            return "defect", None, "ProtocolError without a message"
        return "refused", None, message
    except Exception as exc:  # the invariant: nothing but a Frame or a ProtocolError
        return "defect", None, f"{type(exc).__name__}: {exc}"
    if not isinstance(frame, Frame) or not isinstance(frame.message, P.Message):
        return "defect", None, f"decode returned {frame!r}"
    try:
        again = P.encode(frame.message, frame.req)
    except Exception as exc:
        return "defect", None, f"decoded frame does not re-encode: {type(exc).__name__}: {exc}"
    if again != case.packet:
        return "defect", None, "decoded frame re-encodes to different bytes"
    if case.nfds != LAYOUTS[frame.message.TYPE].fds:
        return "defect", None, f"{frame.message.TYPE.name} accepted with {case.nfds} fds"
    return "ok", frame, ""


def fuzz_decoder(seed: int, count: int, seconds: float | None = None) -> dict[str, Any]:
    """Decode `count` cases (stopping early after `seconds`); the result counts outcomes and lists defects."""
    start = time.perf_counter()
    deadline = None if seconds is None else start + seconds
    outcomes: Counter[str] = Counter()
    by_origin: Counter[str] = Counter()
    ok_by_kind: Counter[str] = Counter()
    built_by_kind: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    templates: Counter[str] = Counter()
    defects: list[dict[str, Any]] = []
    done = 0
    for case in generate(seed, count):
        if deadline is not None and done % 1000 == 0 and time.perf_counter() > deadline:
            break
        done += 1
        status, frame, message = check_decode(case)
        outcomes[status] += 1
        by_origin[f"{case.origin}:{status}"] += 1
        if case.kind >= 0 and case.kind in Msg._value2member_map_:
            built_by_kind[Msg(case.kind).name] += 1
        if frame is not None:
            ok_by_kind[frame.message.TYPE.name] += 1
        elif status == "refused":
            messages[message] += 1
            templates[_template(message)] += 1
        else:
            if len(defects) < 50:
                defects.append({"what": message, "packet": case.packet[:256].hex(), "nfds": case.nfds,
                                "origin": case.origin, "ops": list(case.ops)})
    elapsed = time.perf_counter() - start
    return {
        "seed": seed, "frames": done, "requested": count, "seconds": round(elapsed, 3),
        "rate_per_s": round(done / elapsed) if elapsed else None,
        "decoded_ok": outcomes["ok"], "refused": outcomes["refused"], "defects": outcomes["defect"],
        "by_origin": dict(sorted(by_origin.items())),
        "built_by_type": dict(sorted(built_by_kind.items())),
        "decoded_by_type": dict(sorted(ok_by_kind.items())),
        "distinct_error_messages": len(messages),
        "distinct_error_templates": len(templates),
        "top_error_templates": templates.most_common(40),
        "defect_samples": defects,
    }


# ---------------------------------------------------------------- atheris (coverage-guided), in a child


def _atheris_child(runs: int, corpus: str, extra: list[str]) -> None:
    """Runs inside the child: libFuzzer over decode (the protocol module instrumented); exits when done."""
    import importlib

    import atheris  # type: ignore[import-not-found]

    for name in ("vmmshare.wire.local", "vmmshare.wire.framing"):  # imported at the top: load again, instrumented
        sys.modules.pop(name, None)  # (the framing holds the decoder, local.py its table of message types)
    with atheris.instrument_imports(include=["vmmshare.wire.local", "vmmshare.wire.framing"]):
        proto = importlib.import_module("vmmshare.wire.local")

    def one(data: bytes) -> None:
        if not data:
            return
        try:
            frame = proto.decode(data[1:], data[0] & 7)
        except proto.ProtocolError:
            return
        assert proto.encode(frame.message, frame.req) == data[1:]

    atheris.Setup([sys.argv[0], f"-runs={runs}", "-max_len=66000", "-rss_limit_mb=2048", *extra, corpus], one)
    atheris.Fuzz()


def fuzz_atheris(runs: int, seed: int, seconds: float) -> dict[str, Any]:
    """A coverage-guided run of `runs` executions (bounded by `seconds`); {'available': False} without atheris."""
    try:
        import atheris  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return {"available": False}
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="vmmshare-atheris-") as corpus:
        for i, kind in enumerate(KINDS * 3):  # a seed corpus: valid frames of every type
            packet, nfds = valid_frame(rng, kind)
            Path(corpus, f"seed{i}").write_bytes(bytes([nfds]) + packet)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--atheris-child", str(runs), corpus,
               f"-seed={seed & 0x7FFFFFFF or 1}", f"-max_total_time={max(1, int(seconds))}"]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            return {"available": True, "ok": False, "execs": None, "tail": "atheris child did not finish (hang guard)"}
        elapsed = time.perf_counter() - start
    out = proc.stderr
    done = re.search(r"Done (\d+) runs in (\d+) second", out)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", out)
    corp = re.findall(r"corp: (\d+)/", out)
    crashed = proc.returncode != 0 or "Uncaught Python exception" in out
    return {
        "available": True,
        "ok": not crashed and done is not None,
        "runs_requested": runs,
        "execs": int(done.group(1)) if done else None,
        "seconds": round(elapsed, 2),
        "coverage_edges": int(cov[-1][0]) if cov else None,
        "features": int(cov[-1][1]) if cov else None,
        "corpus_entries": int(corp[-1]) if corp else None,
        "returncode": proc.returncode,
        "tail": out[-3000:] if crashed else "",
    }


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--atheris-child"]:
        _atheris_child(int(argv[1]), argv[2], argv[3:])
        return 0
    ap = NarrowHelp(prog=prog(__file__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=count_option, default=100_000, help="decoder frames (default 100000)")
    ap.add_argument("--seconds", type=seconds_option, default=None, help="time cap for each phase")
    ap.add_argument("--seed", type=whole, default=20251130)
    ap.add_argument("--live", action="store_true", help="also send the frames to a live broker")
    ap.add_argument("--live-frames", type=count_option, default=None,
                    help="frames sent to the broker (default: all --frames; the first N of the same sequence)")
    ap.add_argument("--connections", type=count_option, default=8)
    ap.add_argument("--scripted-rate", type=fraction, default=0.03,
                    help="well-formed requests on live objects interleaved, per fuzz frame (default 0.03)")
    ap.add_argument("--atheris-runs", type=whole, default=2_000_000, help="coverage-guided execs (0: skip)")
    ap.add_argument("--json", default=None, help="write the results here ('-': stdout, instead of the summary)")
    args = ap.parse_args(argv)
    check_outputs(ap, json=None if args.json == "-" else args.json)
    lines: list[str] = []

    result: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *argv]), "cpus": os.cpu_count()}
    dec = fuzz_decoder(args.seed, args.frames, args.seconds)
    result["decoder"] = dec
    lines.append(f"decoder: {dec['frames']} frames in {dec['seconds']} s ({dec['rate_per_s']}/s): "
          f"{dec['decoded_ok']} decoded, {dec['refused']} refused, {dec['defects']} defects; "
          f"{dec['distinct_error_messages']} distinct ProtocolError messages "
          f"({dec['distinct_error_templates']} kinds)")
    ok = dec["defects"] == 0
    if args.atheris_runs:
        ath = fuzz_atheris(args.atheris_runs, args.seed, args.seconds or 600)
        result["atheris"] = ath
        if ath.get("available"):
            lines.append(f"atheris: {ath['execs']} coverage-guided execs in {ath['seconds']} s, "
                         f"cov {ath['coverage_edges']} ft {ath['features']}, ok={ath['ok']}")
            ok = ok and bool(ath["ok"])
        else:
            lines.append("atheris: not installed, coverage-guided run skipped")
    if args.live:
        folder = Path(tempfile.mkdtemp(prefix="vmmshare-fuzz-"))
        try:
            broker = Broker(folder)
            try:
                live = fuzz_live(broker, args.seed, args.live_frames or args.frames, args.seconds, args.connections,
                                 args.scripted_rate)
            finally:
                broker.stop()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        result["live"] = live
        lines.append(f"live: {live['frames_sent']} fuzz frames + {sum(live['scripted_requests'].values())} scripted "
              f"requests in {live['seconds']} s ({live['packets_per_s']} packets/s) over "
              f"{args.connections} connections, {live['frames_with_fds']} with fds; "
              f"replies {readable(live['replies'])}; "
              f"broker fds {live['broker_fd_baseline']} -> {live.get('broker_fd_after')}, RSS "
              f"{live['broker_rss_kb_before']} -> {live.get('broker_rss_kb_after')} kB; "
              f"exports {live['exports_made']}, imports {live['imports_made']}; "
              f"round trip {readable(live.get('round_trip'))}; {live['defects']} defects")
        ok = ok and live["defects"] == 0
    result["ok"] = ok
    if not ok:  # what went wrong, readably: the defects each part recorded
        for part in ("decoder", "atheris", "live"):
            for sample in (result.get(part) or {}).get("defect_samples", [])[:20]:
                lines.append(f"  {part} defect: {readable(sample)[:400]}")
    emit(lines, result, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    entry(main)
