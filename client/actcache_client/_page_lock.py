"""Shared-memory segments page-locked for the CUDA driver: once per process, undone before they unmap.

The driver registers address ranges for the whole process. So a range may be
registered only once, whatever number of ``Stager``s copy out of it (two
``CachedForward``s on one connection take turns with the same reused ring),
and it must be unregistered before its mapping goes: a range left registered
makes the next mapping at that address fail to register
(``cudaErrorHostMemoryAlreadyRegistered``). A segment is unregistered when it
closes or is garbage-collected, whichever comes first, after the last copy
out of it has completed.

A failed registration is not fatal (the batch is collated on the host), but
the CUDA runtime keeps its error as the thread's last error, and PyTorch's
next kernel-launch check would raise it in the middle of training; it is
cleared here.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from actcache.shm import ClientSegment

__all__ = ["PageLocks", "page_locks"]


@dataclass
class _Locked:
    base: int
    #: The latest copy out of the segment (a CUDA event), waited for before unregistering.
    last_copy: Any = None


class PageLocks:
    """Which segments this process has page-locked. ``cudart`` has ``cudaHostRegister`` and
    ``cudaHostUnregister`` (``torch.cuda.cudart()``); ``clear_error`` resets the runtime's last error."""

    def __init__(self, cudart: Any, clear_error: Callable[[], None]) -> None:
        self._cudart = cudart
        self._clear_error = clear_error
        self._lock = threading.Lock()
        self._locked: weakref.WeakKeyDictionary[ClientSegment, _Locked | None] = weakref.WeakKeyDictionary()

    def lock(self, segment: ClientSegment) -> bool:
        """Page-lock ``segment`` unless done already; False if the driver refused it (warned once)."""
        with self._lock:
            if segment in self._locked:
                return self._locked[segment] is not None
            base = np.frombuffer(segment.view, np.uint8).ctypes.data
            error = self._cudart.cudaHostRegister(base, segment.view.nbytes, 0)
            if error != self._cudart.cudaError.success:
                self._clear_error()
                self._locked[segment] = None
                warnings.warn(f"actcache: could not page-lock the shared-memory ring {segment.path} (CUDA error "
                              f"{int(error)}); batches are collated on the host", RuntimeWarning, stacklevel=3)
                return False
            locked = self._locked[segment] = _Locked(base)
            # runs once: at close, or when the segment is collected (before its mapping is dropped)
            release = weakref.finalize(segment, self._unregister, locked)
            release.atexit = False  # the process's exit unmaps and unregisters everything anyway
            segment.on_close.append(release)
            return True

    def copied(self, segment: ClientSegment, event: Any) -> None:
        """``event`` completes with the latest copy out of ``segment`` (which must be locked)."""
        locked = self._locked.get(segment)
        if locked is not None:
            locked.last_copy = event

    def _unregister(self, locked: _Locked) -> None:
        if locked.last_copy is not None:
            locked.last_copy.synchronize()  # the DMA must not read a range the driver no longer holds
        self._cudart.cudaHostUnregister(locked.base)


_shared: PageLocks | None = None
_shared_lock = threading.Lock()


def page_locks() -> PageLocks:
    """The process's ``PageLocks`` (CUDA only)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = PageLocks(torch.cuda.cudart(), _cudart_clear_error())
        return _shared


def _cudart_clear_error() -> Callable[[], None]:
    """``cudaGetLastError`` of the CUDA runtime PyTorch loaded (``torch.cuda.cudart()`` does not bind it)."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "/libcudart" in line})
    for library in [*paths, None]:
        try:
            get_last_error = ctypes.CDLL(library).cudaGetLastError
        except (OSError, AttributeError):
            continue
        return lambda: get_last_error()
    warnings.warn("actcache: the CUDA runtime's cudaGetLastError was not found; a shared-memory ring that cannot "
                  "be page-locked may leave an error for the next kernel launch", RuntimeWarning, stacklevel=2)
    return lambda: None
