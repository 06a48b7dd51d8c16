"""``acl.rt``: devices, contexts, streams, memory, copies, sharing, events and notifies (SPEC §2), as pyACL names
them.

The calls live by concern in `_device`, `_memory`, `_copy`, `_share`, `_ipc`, `_pointers`, `_events` and
`_notifies`; each parses its arguments into
typed values once and hands them to the runtime's part that holds the state. pyACL's other ``acl.rt`` calls
(kernels, groups, ...) exist and return 207000 (`_unsupported`). ``dir(acl.rt)`` lists the API only.
"""

from __future__ import annotations

from . import _copy, _device, _events, _ipc, _memory, _notifies, _pointers, _share
from . import _unsupported as _stand_in
from ._copy import *  # noqa: F403
from ._device import *  # noqa: F403
from ._events import *  # noqa: F403
from ._ipc import *  # noqa: F403
from ._memory import *  # noqa: F403
from ._notifies import *  # noqa: F403
from ._pointers import *  # noqa: F403
from ._share import *  # noqa: F403

_IMPLEMENTED = [*_copy.__all__, *_device.__all__, *_events.__all__, *_ipc.__all__, *_memory.__all__,
                *_notifies.__all__, *_pointers.__all__, *_share.__all__]
for _name in _IMPLEMENTED:
    globals()[_name].__module__ = __name__  # they are acl.rt's calls, wherever they are written
globals().update(_stand_in.stand_ins("acl.rt", _stand_in.RT))

__all__ = sorted([*_IMPLEMENTED, *_stand_in.RT])


def __dir__() -> list[str]:
    return list(__all__)
