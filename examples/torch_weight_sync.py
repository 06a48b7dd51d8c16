"""A trainer updates a model's weights each step; two inference processes read them by handle, zero-copy.

The trainer publishes its state dict into a vmmshare bucket (one shared allocation, two versions); each inference
process subscribes with the bucket's ticket, takes the latest whole version as tensor views, loads it into its own
copy of the model and answers a query. The trainer checks every answer against its own model at that version.

Run: python examples/torch_weight_sync.py   (needs torch: pip install 'vmmshare[torch]')
"""

from __future__ import annotations

import queue
import sys
from typing import Any

import torch
import torch.multiprocessing as mp

import vmmshare.torch as vt

STEPS = 5
QUERY_SEED = 7


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def query() -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(QUERY_SEED))


def inference(name: str, hello: Any, tickets: Any, answers: Any) -> None:
    """An inference process: tell the trainer its host pid, subscribe, answer once per version it is asked."""
    hello.put((name, vt.bare_pid()))
    sub = vt.Subscriber(tickets.get(timeout=60))
    net = model()
    x = query()
    while True:
        wanted = tickets.get(timeout=60)
        if wanted is None:
            break
        with sub.latest() as weights:  # one whole version, pinned while we load it
            net.load_state_dict(weights.tensors)
            version = weights.version
        with torch.no_grad():
            answers.put((name, version, net(x).tolist()))
    sub.close()


def main() -> int:
    ctx = mp.get_context("spawn")
    hello, answers = ctx.Queue(), ctx.Queue()
    tickets = {n: ctx.Queue() for n in ("reader-a", "reader-b")}
    readers = [ctx.Process(target=inference, args=(n, hello, q, answers)) for n, q in tickets.items()]
    for p in readers:
        p.start()
    try:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        pub = vt.Publisher(net.state_dict())
        print(f"trainer: a bucket of {len(pub.entries)} tensors, {pub.nbytes} bytes a version, one handle")
        pids = dict(hello.get(timeout=60) for _ in readers)
        pub.allow(pids.values())  # the readers' host pids: only they may import the bucket
        pub.publish(net.state_dict())
        for q in tickets.values():
            q.put(pub.ticket())
        x = query()
        for step in range(1, STEPS + 1):
            loss = net(torch.randn(32, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            version = pub.publish(net.state_dict())
            with torch.no_grad():
                expect = net(x)
            for q in tickets.values():
                q.put(version)
            for _ in readers:
                name, seen, out = answers.get(timeout=60)
                if seen != version or not torch.allclose(torch.tensor(out), expect):
                    print(f"{name} answered for version {seen} with other weights", file=sys.stderr)
                    return 1
            print(f"step {step}: loss {loss.item():.4f}, version {version} published; both readers answered with it")
        for q in tickets.values():
            q.put(None)
        for p in readers:
            p.join(60)
        pub.close()
        print("done: every answer came from the weights of the version the trainer had just published")
        return 0 if all(p.exitcode == 0 for p in readers) else 1
    except queue.Empty:
        print("a reader did not answer in time", file=sys.stderr)
        return 1
    finally:
        for p in readers:
            if p.is_alive():
                p.kill()
                p.join()


if __name__ == "__main__":
    sys.exit(main())
