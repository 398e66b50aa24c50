"""Keep freed heap memory for reuse (glibc), so numpy temporaries do not fault in fresh pages.

By default glibc hands a freed block back to the kernel as soon as the free space at the top
of the heap passes its trim threshold (dynamically about twice the largest freed block), and
serves blocks above its mmap threshold with fresh mappings. The compare loops allocate and
free temporaries of a few hundred KB to a few MB per layer and round, so every new temporary
page-faulted in zeroed pages: ``Moments.add`` of one 121 x 576 record took 1.6 ms instead of
0.29 ms. Raising both thresholds once per process removes that; the heap then keeps up to
``TRIM_BYTES`` of freed memory, which counts in the resident set.

A process-wide setting: called by the srdd-compare entry point (and, when the parent has it,
by the worker processes it starts), never as a side effect of a library call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_BYTES = 32 << 20  # glibc's largest allowed mmap threshold on 64-bit
TRIM_BYTES = 256 << 20

_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where not glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _mallopt()
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    _done = ok
    return ok


def _mallopt():
    """glibc's mallopt: among the process's own symbols (``find_library`` runs ``ldconfig -p``,
    10 ms before a command can start), else from the C library found by name."""
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt


def keeps_freed_memory() -> bool:
    """Whether ``keep_freed_memory`` took effect in this process."""
    return _done


GC_YOUNG = 200_000  # container allocations between two collections of the youngest objects


def fewer_collections() -> None:
    """Run the cyclic garbage collector rarely, and never over the objects alive now (the
    imports'): a compare makes few reference cycles, and its collections (700 allocations
    apart by default, with every object of the imports and pandas at each full one) took
    about 5% of the CPU of a 2-core compare. Process-wide, for the srdd-compare entry point
    (its forked workers inherit it), like ``keep_freed_memory``."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
