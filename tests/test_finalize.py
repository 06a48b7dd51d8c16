"""The light finalizer of the Pythonic objects (api/_finalize.py): what weakref.finalize promised them, kept."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from vmmshare.api._finalize import Finalizer, live_objects


class Thing:
    """Something to finalize (plain objects take weak references)."""


def test_it_runs_once_when_its_object_is_collected() -> None:
    ran: list[int] = []
    obj = Thing()
    f = Finalizer(obj, ran.append, 1)
    assert f.alive and ran == []
    del obj
    gc.collect()
    assert ran == [1] and not f.alive
    assert f() is None and ran == [1]  # dead: calling it does nothing


def test_calling_it_runs_it_now_and_never_again() -> None:
    ran: list[str] = []
    obj = Thing()
    f = Finalizer(obj, lambda *a: ran.append("".join(a)) or "result", "a", "b")
    assert f() == "result" and ran == ["ab"] and not f.alive
    assert f() is None and f.detach() is None
    del obj
    gc.collect()
    assert ran == ["ab"]


def test_detach_kills_it_and_hands_back_what_it_would_have_called() -> None:
    ran: list[int] = []
    obj = Thing()
    f = Finalizer(obj, ran.append, 7)
    got = f.detach()
    assert got is not None
    assert got[0] is obj and got[1] == ran.append and got[2] == (7,) and got[3] == {}
    assert not f.alive and f.detach() is None and f() is None
    del obj, got
    gc.collect()
    assert ran == []


def test_only_one_of_many_threads_calling_it_runs_it() -> None:
    for _ in range(50):
        ran: list[int] = []
        obj = Thing()
        f = Finalizer(obj, ran.append, 1)
        start = threading.Barrier(4)

        def race(f: Finalizer = f, start: threading.Barrier = start) -> None:
            start.wait()
            if f.detach() is None:
                f()

        threads = [threading.Thread(target=race) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert ran in ([], [1]) and not f.alive
        del obj


def test_live_objects_are_the_objects_of_live_finalizers() -> None:
    a, b = Thing(), Thing()
    fa, fb = Finalizer(a, print), Finalizer(b, print)
    fb.detach()
    found = [o for o in live_objects() if isinstance(o, Thing)]
    assert any(o is a for o in found) and not any(o is b for o in found)
    fa.detach()


def test_at_exit_the_live_ones_run_newest_first_and_a_collected_one_is_not_run_twice(tmp_path: Path) -> None:
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import gc, sys
        from vmmshare.api._finalize import Finalizer

        class Thing:
            pass

        def say(word):
            sys.stdout.write(word + "\\n")
            sys.stdout.flush()

        kept = [Thing() for _ in range(3)]
        for i, obj in enumerate(kept):
            Finalizer(obj, say, f"exit{i}")
        gone = Thing()
        Finalizer(gone, say, "collected")
        del gone
        gc.collect()
        detached = Thing()
        Finalizer(detached, say, "never").detach()
        late = Thing()

        def make_late():
            say("makes-late")
            Finalizer(late, say, "late")  # made while the exit run is under way: it runs too

        Finalizer(Thing, make_late)
        say("end")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["collected", "end", "makes-late", "late", "exit2", "exit1", "exit0"]
