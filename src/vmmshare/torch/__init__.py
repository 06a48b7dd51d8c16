"""vmmshare.torch: torch tensors on vmmshare memory, sent to other processes by handle (``vmmshare[torch]``).

    import torch, vmmshare.torch as vt
    t = vt.empty((4096, 4096), dtype=torch.bfloat16)     # a tensor on exportable memory
    fn, args = vt.reduce_tensor(t, pids=[consumer_pid])  # picklable, like torch.multiprocessing.reductions
    t2 = fn(*args)                                       # in the consumer: the same memory, zero-copy

Handles are copied by value (no fd side channel, no ptrace right), trustlists hold host pids (so a consumer in a
container's pid namespace works), and a consumer keeps its tensors when the producer dies. See docs/torch.md.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("vmmshare.torch needs torch: pip install 'vmmshare[torch]'") from exc

from ._buckets import BucketEntry, BucketTicket, Publisher
from ._mp import install, installed, trust, uninstall
from ._subscriber import Snapshot, Subscriber
from ._tensors import bare_pid, empty, empty_like, is_shared, rebuild_tensor, reduce_tensor, share_, zeros

__all__ = [
    "BucketEntry",
    "BucketTicket",
    "Publisher",
    "Snapshot",
    "Subscriber",
    "bare_pid",
    "empty",
    "empty_like",
    "install",
    "installed",
    "is_shared",
    "rebuild_tensor",
    "reduce_tensor",
    "share_",
    "trust",
    "uninstall",
    "zeros",
]
