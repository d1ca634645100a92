"""The C heap of a serving process: fewer malloc arenas, and freed memory handed back when idle.

A step allocates and frees large temporaries (prefill activations, attention scores, batch
metadata), and weight loading frees full-precision copies. glibc keeps freed chunks in its heaps
for reuse, so a server's resident memory stays at its busiest step's high-water mark long after the
traffic is gone. `malloc_trim(0)` returns the free pages of every arena; it costs a few
milliseconds, so the engine thread calls it only on going idle, never between busy steps.

glibc also gives a thread that allocates while another holds the lock its own arena, up to 8 per
core, and each arena keeps its own scattered live chunks and pages. A server has many such threads
(the engine thread, tokenizer workers, the platform's request threads), while on a CPU host only
the engine thread allocates much, so two arenas are enough. After `bench/startup.py`'s 64-request
workload the kserve process held 1,357-1,363 MiB against 1,365-1,372 (the Triton stub: no
difference); where oneDNN runs the GEMMs and allocates per batch shape, 1,374 against 1,400 MiB
for kserve and 1,345 against 1,352 for the Triton tree.

Both are no-ops where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_ARENA_MAX = -8
"""mallopt's parameter number for the arena limit (glibc's malloc.h)."""
SERVING_MALLOC_ARENAS = 2
ARENA_ENV = "MALLOC_ARENA_MAX"
"""An operator's setting of this variable (read by glibc at start-up) wins over ours."""


@functools.lru_cache(maxsize=None)
def _libc_function(name: str, argtypes: tuple, restype):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = list(argtypes), restype
    return function


def release_free_heap() -> bool:
    """Return free heap pages to the OS; True if the C library offers it (glibc)."""
    trim = _libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is None:
        return False
    trim(0)
    return True


def limit_malloc_arenas(arenas: int = SERVING_MALLOC_ARENAS) -> bool:
    """Let threads that start from now on share at most `arenas` malloc arenas (threads that have
    one keep it). False if the C library cannot, or MALLOC_ARENA_MAX already decides."""
    if ARENA_ENV in os.environ:
        return False
    mallopt = _libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return mallopt is not None and mallopt(M_ARENA_MAX, arenas) == 1
