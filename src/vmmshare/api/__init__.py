"""The Pythonic objects (Memory, Mapping, pools, buffers, views) over the runtime, re-exported by `vmmshare`."""
