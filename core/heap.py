"""Handing freed heap memory back to the operating system when the engine goes idle.

A step allocates and frees large temporaries (prefill activations, attention scores, batch
metadata), and weight loading frees full-precision copies. glibc keeps freed chunks in its heaps
for reuse, so a server's resident memory stays at its busiest step's high-water mark long after the
traffic is gone. `malloc_trim(0)` returns the free pages of every arena; it costs a few
milliseconds, so the engine thread calls it only on going idle, never between busy steps. A no-op
where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return free heap pages to the OS; True if the C library offers it (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
