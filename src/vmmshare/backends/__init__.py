"""Where memory lives: `host` (memfd + mmap) and, optionally, `cuda` (GPU device memory)."""
