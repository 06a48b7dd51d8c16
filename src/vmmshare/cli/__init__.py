"""The ``vmmshare`` command line and its tools (demo, bench, doctor, cluster, stress); the library never imports it."""

from .commands import main as main
