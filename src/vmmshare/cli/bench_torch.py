"""vmmshare bench --torch: sharing a state dict with another process, vmmshare against torch's own ways, in one run.

Measured side by side (medians over repetitions, with the 10th-90th percentile spread), from the moment the
producer starts sharing ordinary tensors to the moment the consumer process has read its first tensor:
- a 1 GiB state dict of 200 tensors: a vmmshare bucket (Publisher + Subscriber), torch.multiprocessing
  (`share_memory_()` then a torch Queue: one shared file per tensor, fds on a side socket), and pickling the tensors
  through a Pipe; then the same with the weights already in shared memory (a published bucket; tensors after
  `share_memory_()`), where only the sending differs;
- per update: a bucket publish of every tensor and of a tenth of them, until the consumer holds the new version,
  each against a plain memcpy of the bytes that changed (the anchor), and torch sharing the new tensors again;
- 1,000 small tensors: one handle per tensor (reduce_tensor / rebuild_tensor) against one bucket.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import pickle
import sys
from multiprocessing.connection import Connection
from typing import Any

from .bench_measures import GiB, MiB, fmt_size, now_ns, stats_of, write_json
from .console import FAILED, OK, USAGE, Parser, Progress, check_outputs, count_option, plain, run_main, say_error


def _state(total: int, count: int) -> dict[str, Any]:
    """`count` float32 tensors of `total` bytes: half of them matrices with almost all the bytes, half small
    vectors (biases, norms), as in a model's state dict."""
    import torch

    big, small = count // 2, count - count // 2
    small_bytes = max(4096, total // 256 // small // 4 * 4)
    big_elems = (total - small * small_bytes) // big // 4
    cols = 1024
    out: dict[str, Any] = {}
    for i in range(big):
        out[f"layers.{i}.weight"] = torch.ones(big_elems // cols, cols)
        out[f"layers.{i}.bias"] = torch.ones(small_bytes // 4)
    for i in range(small - big):
        out[f"norm.{i}"] = torch.ones(small_bytes // 4)
    return out


# ---------------------------------------------------------------- the consumer process


def consumer_main(conn: Connection, torch_queue: Any) -> None:
    """The other process: receives by each way on request and answers with the time its first tensor was usable."""
    import vmmshare.torch as vt

    conn.send(vt.bare_pid())
    sub: Any = None
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "bucket":  # subscribe, map the latest version, read a tensor
            if sub is not None:
                sub.close()
            sub = vt.Subscriber(pickle.loads(msg[1]))
            snap = sub.latest()
            float(snap[msg[2]][0].sum())
            conn.send((now_ns(), snap.version))
            snap.release()
        elif kind == "update":  # the new version is published: take it and read a tensor that changed
            snap = sub.latest()
            float(snap[msg[1]][0].sum())
            conn.send((now_ns(), snap.version))
            snap.release()
        elif kind == "torch":
            got = torch_queue.get()
            float(next(iter(got.values()))[0].sum())
            conn.send((now_ns(), len(got)))
            del got
        elif kind == "pickle":
            got = pickle.loads(conn.recv_bytes())
            float(next(iter(got.values()))[0].sum())
            conn.send((now_ns(), len(got)))
            del got
        elif kind == "handles":  # one reduced tensor per handle: rebuild every one
            got = [fn(*args) for fn, args in pickle.loads(msg[1])]
            float(got[0].sum())
            conn.send((now_ns(), len(got)))
            del got
        elif kind == "drop":
            if sub is not None:
                sub.close()
                sub = None
            gc.collect()
            conn.send(True)


# ---------------------------------------------------------------- the producer's side of each way


def _ms(t0: int, t1: int) -> float:
    return (t1 - t0) / 1e6


def _bucket_first(conn: Connection, pid: int, sd: dict[str, Any]) -> tuple[float, Any]:
    import vmmshare.torch as vt

    first = next(iter(sd))
    t0 = now_ns()
    pub = vt.Publisher(sd, pids=[pid])
    pub.publish(sd)
    conn.send(("bucket", pickle.dumps(pub.ticket()), first))
    t1, _ = conn.recv()
    return _ms(t0, t1), pub


def _bucket_send(conn: Connection, pub: Any, first: str) -> float:
    """The weights already live in a published bucket: send its ticket, until the consumer reads a tensor."""
    conn.send(("drop",))
    conn.recv()
    t0 = now_ns()
    conn.send(("bucket", pickle.dumps(pub.ticket()), first))
    t1, _ = conn.recv()
    return _ms(t0, t1)


def _torch_send(conn: Connection, q: Any, shared: dict[str, Any]) -> float:
    """The tensors are already in shared memory (share_memory_() done): put them on the queue."""
    t0 = now_ns()
    conn.send(("torch",))
    q.put(shared)
    t1, _ = conn.recv()
    return _ms(t0, t1)


def _torch_first(conn: Connection, q: Any, sd: dict[str, Any]) -> float:
    t0 = now_ns()
    shared = {k: v.clone().share_memory_() for k, v in sd.items()}  # share_memory_ moves the tensor: clone first
    conn.send(("torch",))
    q.put(shared)
    t1, _ = conn.recv()
    del shared
    return _ms(t0, t1)


def _pickle_first(conn: Connection, sd: dict[str, Any]) -> float:
    t0 = now_ns()
    data = pickle.dumps(sd, protocol=pickle.HIGHEST_PROTOCOL)
    conn.send(("pickle",))
    conn.send_bytes(data)
    del data
    t1, _ = conn.recv()
    return _ms(t0, t1)


def _updates(conn: Connection, pub: Any, sd: dict[str, Any], names: list[str],
             reps: int) -> tuple[list[float], list[float]]:
    """Publish `names` changed, `reps` times, each until the consumer holds the new version; each next to its anchor,
    a memcpy of the same tensors into private ones (taken right before, so both see the same load)."""
    import torch

    private = {n: torch.empty_like(sd[n]) for n in names}
    for n in names:
        private[n].copy_(sd[n])  # faulted in: the anchor measures the copy alone
    out, anchor = [], []
    for r in range(reps):
        for n in names:
            sd[n].fill_(float(r + 2))
        t0 = now_ns()
        for n in names:
            private[n].copy_(sd[n])
        anchor.append(_ms(t0, now_ns()))
        t0 = now_ns()
        version = pub.publish(sd, changed=names)
        conn.send(("update", names[0]))
        t1, seen = conn.recv()
        if seen != version:
            raise RuntimeError(f"the consumer saw version {seen}, not {version}")
        out.append(_ms(t0, t1))
    del private
    return out, anchor


def _small(conn: Connection, pid: int, count: int, reps: int) -> dict[str, dict[str, float]]:
    import torch

    import vmmshare.torch as vt

    per_handle, bucket = [], []
    sd = {f"t{i}": torch.ones(256) for i in range(count)}
    for r in range(reps + 1):
        tensors = [vt.empty(256) for _ in range(count)]
        for t in tensors:
            t.fill_(1.0)
        t0 = now_ns()
        reduced = [vt.reduce_tensor(t, pids=[pid]) for t in tensors]
        conn.send(("handles", pickle.dumps(reduced)))
        t1, _ = conn.recv()
        del tensors, reduced
        gc.collect()
        t2 = now_ns()
        pub = vt.Publisher(sd, pids=[pid])
        pub.publish(sd)
        conn.send(("bucket", pickle.dumps(pub.ticket()), "t0"))
        t3, _ = conn.recv()
        conn.send(("drop",))
        conn.recv()
        pub.close()
        if r:  # the first round warms both up
            per_handle.append(_ms(t0, t1))
            bucket.append(_ms(t2, t3))
    return {"handle_per_tensor_ms": stats_of(per_handle), "one_bucket_ms": stats_of(bucket)}


def run(total: int, count: int, reps: int, small_count: int, progress: Any = None) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as tmp

    step = progress.step if progress is not None else (lambda _: None)
    ctx = tmp.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    step("starting the consumer process")
    peer = ctx.Process(target=consumer_main, args=(b, q))
    peer.start()
    b.close()
    pid = a.recv()
    res: dict[str, Any] = {"state_dict": {"bytes": total, "tensors": count}, "reps": reps,
                           "torch": torch.__version__}
    try:
        sd = _state(total, count)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        res["state_dict"]["bytes"] = nbytes
        bucket, torch_mp, pickled = [], [], []
        for r in range(reps):
            step(f"first usable tensor: vmmshare bucket ({r + 1}/{reps})")
            ms, pub = _bucket_first(a, pid, sd)
            bucket.append(ms)
            if r < reps - 1:
                a.send(("drop",))
                a.recv()
                pub.close()
                del pub
                gc.collect()
            step(f"first usable tensor: torch.multiprocessing ({r + 1}/{reps})")
            torch_mp.append(_torch_first(a, q, sd))
            gc.collect()
            step(f"first usable tensor: pickle ({r + 1}/{reps})")
            pickled.append(_pickle_first(a, sd))
            gc.collect()
        step("first usable tensor, the weights already in shared memory")
        shared = {k: v.clone().share_memory_() for k, v in sd.items()}
        sent_bucket = [_bucket_send(a, pub, next(iter(sd))) for _ in range(reps)]
        sent_torch = [_torch_send(a, q, shared) for _ in range(reps)]
        del shared
        gc.collect()
        res["already_shared"] = {"vmmshare_bucket_ms": stats_of(sent_bucket),
                                 "torch_multiprocessing_ms": stats_of(sent_torch)}
        res["already_shared"]["speedup_vs_torch"] = (res["already_shared"]["torch_multiprocessing_ms"]["median"]
                                                     / res["already_shared"]["vmmshare_bucket_ms"]["median"])
        first: dict[str, Any] = {"vmmshare_bucket_ms": stats_of(bucket), "torch_multiprocessing_ms": stats_of(torch_mp),
                                 "pickle_ms": stats_of(pickled)}
        first["speedup_vs_torch"] = first["torch_multiprocessing_ms"]["median"] / first["vmmshare_bucket_ms"]["median"]
        first["speedup_vs_pickle"] = first["pickle_ms"]["median"] / first["vmmshare_bucket_ms"]["median"]
        res["first_usable"] = first
        a.send(("drop",))
        a.recv()
        a.send(("bucket", pickle.dumps(pub.ticket()), next(iter(sd))))  # subscribed again, for the updates
        a.recv()
        big = [n for n in sd if n.endswith(".weight")]
        tenth = big[: max(1, len(big) // 10)]
        tenth_bytes = sum(sd[n].numel() * 4 for n in tenth)
        step("per update: every tensor")
        _updates(a, pub, sd, list(sd), 1)  # both slots written once since the first publish
        full, full_copy = _updates(a, pub, sd, list(sd), reps)
        step("per update: a tenth of the tensors")
        _updates(a, pub, sd, tenth, 1)
        part, part_copy = _updates(a, pub, sd, tenth, reps * 3)
        a.send(("drop",))
        a.recv()
        pub.close()
        del pub
        gc.collect()
        res["update"] = {
            "all_tensors": {"bytes": nbytes, "vmmshare_bucket_ms": stats_of(full), "memcpy_ms": stats_of(full_copy),
                            "torch_reshare_ms": first["torch_multiprocessing_ms"]},
            "tenth": {"bytes": tenth_bytes, "tensors": len(tenth), "vmmshare_bucket_ms": stats_of(part),
                      "memcpy_ms": stats_of(part_copy)},
        }
        for row, (b_ms, c_ms) in zip(res["update"].values(), ((full, full_copy), (part, part_copy)), strict=True):
            row["ratio_to_memcpy"] = stats_of([x / y for x, y in zip(b_ms, c_ms, strict=True)])["median"]
        del sd
        gc.collect()
        step(f"{small_count} small tensors: a handle each vs one bucket")
        small = _small(a, pid, small_count, max(3, reps))
        res["small"] = {**small, "tensors": small_count,
                        "speedup": small["handle_per_tensor_ms"]["median"] / small["one_bucket_ms"]["median"]}
    finally:
        with contextlib.suppress(OSError):
            a.send(("stop",))
        peer.join(60)
        if peer.is_alive():
            peer.kill()
            peer.join()
    return res


def print_report(res: dict[str, Any], out: Any = sys.stdout) -> None:
    def m(s: dict[str, float]) -> str:
        return f"{s['median']:9.1f} ms  ({s['p10']:.1f}-{s['p90']:.1f})"

    sd, first = res["state_dict"], res["first_usable"]
    print(f"vmmshare bench --torch (torch {res['torch']}, {res['reps']} repetitions; medians, 10th-90th percentile)",
          file=out)
    print(f"\nfirst usable tensor in the consumer, a {fmt_size(sd['bytes'])} state dict of {sd['tensors']} tensors:",
          file=out)
    print(f"  vmmshare bucket          {m(first['vmmshare_bucket_ms'])}", file=out)
    print(f"  torch.multiprocessing    {m(first['torch_multiprocessing_ms'])}   "
          f"{first['speedup_vs_torch']:.1f}x the bucket's time", file=out)
    print(f"  pickle through a Pipe    {m(first['pickle_ms'])}   {first['speedup_vs_pickle']:.1f}x", file=out)
    sent = res["already_shared"]
    print("\nthe same, with the weights already in shared memory (a published bucket; share_memory_() done):",
          file=out)
    print(f"  vmmshare bucket          {m(sent['vmmshare_bucket_ms'])}", file=out)
    print(f"  torch.multiprocessing    {m(sent['torch_multiprocessing_ms'])}   "
          f"{sent['speedup_vs_torch']:.1f}x the bucket's time", file=out)
    print("\nper update, until the consumer holds the new version:", file=out)
    for label, row in (("every tensor", res["update"]["all_tensors"]), ("a tenth", res["update"]["tenth"])):
        print(f"  {label:<13} {fmt_size(row['bytes']):>7}  bucket {m(row['vmmshare_bucket_ms'])}   memcpy "
              f"{m(row['memcpy_ms'])}   {row['ratio_to_memcpy']:.2f}x memcpy", file=out)
    print(f"  torch shares the tensors again: {m(res['update']['all_tensors']['torch_reshare_ms'])}", file=out)
    small = res["small"]
    print(f"\n{small['tensors']} small tensors to the consumer:", file=out)
    print(f"  a handle per tensor      {m(small['handle_per_tensor_ms'])}", file=out)
    print(f"  one bucket               {m(small['one_bucket_ms'])}   the bucket is "
          f"{small['speedup']:.1f}x faster", file=out)


def main(argv: list[str] | None = None) -> int:
    """`vmmshare bench --torch`: a closed stdout or Ctrl-C ends it without a traceback."""
    return run_main(lambda: _main(sys.argv[1:] if argv is None else argv), "vmmshare bench")


def _main(argv: list[str]) -> int:
    ap = Parser(prog="vmmshare bench --torch", description=plain(__doc__),
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Needs torch (pip install 'vmmshare[torch]'). Exit status: 0 done, 1 a measurement failed, "
                       "2 bad usage or configuration.")
    ap.add_argument("--quick", action="store_true", help="CI-sized: a 64 MiB state dict, 3 repetitions")
    ap.add_argument("--reps", type=count_option, help="repetitions (default 5)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    check_outputs(ap, json=args.json)
    try:
        import torch  # noqa: F401
    except ImportError:
        say_error("vmmshare bench --torch", "needs torch, which is not installed: pip install 'vmmshare[torch]'")
        return USAGE
    from ..errors import AclError

    total, reps = (64 * MiB, 3) if args.quick else (GiB, 5)
    try:
        with Progress("vmmshare bench --torch") as progress:
            res = run(total, 200, args.reps or reps, 1000, progress)
    except AclError as exc:
        say_error("vmmshare bench --torch", f"failed: {exc}")
        return FAILED
    except (EOFError, OSError):
        say_error("vmmshare bench --torch", "failed: the consumer process exited early (its error is above)")
        return FAILED
    if args.json:
        try:
            write_json(res, args.json)
        except OSError as exc:
            say_error("vmmshare bench --torch", f"cannot write {exc.filename}: {exc.strerror}")
            return FAILED
    print_report(res)
    return OK


if __name__ == "__main__":
    sys.exit(main())
