"""Pure codecs, no I/O: the handles' bytes, the allocation properties, and the two protocols (a process and its
broker: `local`; broker and broker: `peer`) on one framing."""
