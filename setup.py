"""The compiled fast path of vmmshare.sockets.packets, built with the system compiler where there is one.

Optional: without a compiler (or Python's headers) the build skips it and the package installs all the same,
using the pure-Python packets.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("vmmshare.sockets._fastpackets", ["src/vmmshare/sockets/_fastpackets.c"],
                             extra_compile_args=["-O2", "-Wall", "-Wextra"], optional=True)])
