"""`python -m vmmshare.broker` as a process: configuration, signals, and the exit statuses of `run`."""

from __future__ import annotations

import errno
import logging
import selectors
import signal
import socket
from pathlib import Path

from ..config import Config, ConfigError, check_socket_path
from ..fabric.agent import FabricSetupError
from .server import WAKE, Broker
from .socketfile import InUse, passed_socket

log = logging.getLogger("vmmshare.broker")


def run(config: Config, path: Path | None = None, idle: float | None = None, multi_user: bool = False,
        ready_fd: int = -1, auto: bool = False) -> int:
    """Run a broker of this configuration (`Config.from_env(broker=True)`) in this process until it is stopped
    (SIGTERM/SIGINT) or, with `idle`, goes idle. An auto-started broker (`auto`) lingers VMMSHARE_BROKER_IDLE seconds
    unless `idle` says otherwise.

    Exit status: 0 stopped, 1 could not serve, 2 bad configuration, 3 another broker serves the path."""
    try:
        if path is not None:
            check_socket_path(path, "--socket")
    except ConfigError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    if auto and idle is None:
        idle = config.broker_idle
    broker = Broker(path or config.socket_path, config, idle, multi_user)
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)  # a signal wakes the event loop
    broker.sel.register(wake_r, selectors.EVENT_READ, WAKE)
    signal.signal(signal.SIGTERM, broker.stop)
    signal.signal(signal.SIGINT, broker.stop)
    try:
        broker.bind(passed_socket(broker.path, multi_user))  # systemd socket activation passes the listener
    except ConfigError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    except FabricSetupError as exc:
        log.error("cannot serve %s: %s", broker.path, exc)
        broker.close()
        return 2
    except InUse as exc:
        log.error("cannot serve %s: %s", broker.path, exc)
        return 3
    except OSError as exc:
        log.error("cannot serve %s: %s", broker.path, exc)
        return 3 if exc.errno == errno.EADDRINUSE else 1
    broker.serve(ready_fd)
    return 0
