"""Keep large buffers in the heap: fewer page faults per message (glibc only).

glibc serves allocations above ``M_MMAP_THRESHOLD`` with a fresh ``mmap``, so every multi-MiB message
pays the page faults of fresh memory again (warm Fetch is faster without: docs/design/serving.md).
The daemon calls ``tune_malloc()`` at start (``MALLOC_MMAP_THRESHOLD_`` does it from outside).
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
_MMAP_THRESHOLD_MAX = 32 << 20


def tune_malloc(mmap_threshold: int = _MMAP_THRESHOLD_MAX, trim_threshold: int = 1 << 30) -> bool:
    """Serve allocations below ``mmap_threshold`` bytes from the heap and trim it only past ``trim_threshold``.

    Returns False (and changes nothing) where the C library has no ``mallopt``.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, _MMAP_THRESHOLD_MAX))
    return bool(ok and mallopt(_M_TRIM_THRESHOLD, trim_threshold))
