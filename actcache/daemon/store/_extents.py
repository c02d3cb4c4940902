"""Explicit reads of LMDB values: find each value's bytes in ``data.mdb`` and ``pread`` them.

Why: a value above about 2 KB lives in contiguous overflow pages, which the memory map faults in a
page (or readahead window) at a time, while one ``pread`` per value runs near the disk's speed
(docs/design/store.md, docs/design/serving.md). Its leaf node (``_pages``) gives the first overflow
page and the size. Every explicit read checks the page header it reads and the caller verifies the
checksum; whatever does not match is copied from the map instead: an unknown layout costs speed,
never correctness. LMDB writes with ``pwrite`` (no ``writemap``) and values are read while the read
transaction that located them is open, so the bytes are the ones the map would give.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actcache.daemon.store._pages import PAGE_HEADER_BYTES, LeafPages, is_overflow_page
from actcache.keys import KEY_BYTES, sample_ids_of

__all__ = ["Extent", "ExtentHints", "ReadSession", "ValueFile"]

_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


@dataclass(frozen=True, slots=True)
class Extent:
    """Where a stored value is: ``length`` bytes at file ``offset``, or its bytes already in ``inline``
    (small values stored in their leaf, and values that could not be located)."""

    offset: int
    length: int
    inline: bytes | None = None

    @classmethod
    def at_page(cls, pgno: int, length: int, page_size: int) -> "Extent":
        """A value of ``length`` bytes in the overflow pages from page ``pgno`` on."""
        return cls(pgno * page_size + PAGE_HEADER_BYTES, length)

    @property
    def read_start(self) -> int:
        """File offset an explicit read starts at: the page header before the value."""
        return self.offset - PAGE_HEADER_BYTES

    @property
    def read_bytes(self) -> int:
        """Bytes an explicit read transfers (the page header included); 0 for inline values."""
        return 0 if self.inline is not None else self.length + PAGE_HEADER_BYTES


class ValueFile:
    """``data.mdb`` opened for explicit reads (``POSIX_FADV_RANDOM``: no readahead around them); thread-safe."""

    def __init__(self, path: Path, page_size: int) -> None:
        self.page_size = page_size
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._nowait = bool(_NOWAIT)
        #: The file's B-tree leaf pages, read on the same descriptor.
        self.pages = LeafPages(self._fd, page_size)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def advise(self, extent: Extent) -> None:
        """Ask the kernel to start reading ``extent`` into the page cache (asynchronous)."""
        if extent.inline is None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, extent.read_start, extent.read_bytes, os.POSIX_FADV_WILLNEED)

    def resident(self, extent: Extent) -> bool | None:
        """Is the end of ``extent`` in the page cache? None when the kernel cannot tell (no RWF_NOWAIT)."""
        if extent.inline is not None:
            return True
        got = self._pread_nowait(memoryview(bytearray(1)), extent.offset + extent.length - 1)
        return None if got is None else got == 1

    def _pread_nowait(self, view: memoryview, offset: int) -> int | None:
        """Bytes read without waiting for the disk (0 if none are cached); None if unsupported."""
        if not self._nowait:
            return None
        try:
            return os.preadv(self._fd, [view], offset, _NOWAIT)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            self._nowait = False
            return None

    def read(self, extent: Extent) -> tuple[memoryview | None, bool | None]:
        """The value's bytes (None when the page header read with them does not match), and whether
        they all came from the page cache (None when the kernel cannot tell)."""
        start, size = extent.read_start, extent.read_bytes
        view = np.empty(size, np.uint8).data  # uninitialized: pread fills it
        got = self._pread_nowait(view, start)
        resident = None if got is None else got == size
        got = got or 0
        while got < size:
            n = os.preadv(self._fd, [view[got:]], start + got)
            if n == 0:
                return None, resident
            got += n
        return (view[PAGE_HEADER_BYTES:] if is_overflow_page(view, start, self.page_size) else None), resident


class PageCacheGuess:
    """Whether a reader's recent explicit reads all came from the page cache; one per reader. After
    ``WARM_AFTER`` such reads in a row, values are copied out of the map instead, a run per LMDB call
    (``ReadSession.copy_run``). One lookup in ``CHECK_EVERY`` is checked again; one that was not cached
    ends the streak. A wrong guess costs speed, never bytes."""

    WARM_AFTER = 32
    CHECK_EVERY = 64

    def __init__(self) -> None:
        self._streak = 0
        self._lookups = 0

    @property
    def warm(self) -> bool:
        return self._streak >= self.WARM_AFTER

    def check_due(self, count: int = 1) -> bool:
        """Count ``count`` lookups; True if one of them is due for a check."""
        before, self._lookups = self._lookups, self._lookups + count
        return self._lookups // self.CHECK_EVERY != before // self.CHECK_EVERY

    def use_map(self) -> bool:
        """Whether the next value is copied out of the map rather than read explicitly."""
        return self.warm and not self.check_due()

    def saw(self, resident: bool | None) -> None:
        """An explicit read came (True) or did not come (False, None: unknown) from the page cache."""
        self._streak = self._streak + 1 if resident else 0


_NONE = np.empty(0, np.int64)  # ExtentHints' arrays before its first lesson


class ExtentHints:
    """Where the values of one schedule are, learned a leaf page (about 80 values) per lookup, for read
    hints only; thread-safe. A stale hint costs a useless read-ahead, never bytes: the reader locates
    each value again. Keeps one extent per position of the schedule (``prefix``: its group's key
    prefix; ``sample_ids``, ``variants``: its order); each hint is used once."""

    def __init__(self, prefix: bytes, sample_ids: np.ndarray, variants: np.ndarray | None = None) -> None:
        self._prefix = prefix
        self._ids, self._variants = sample_ids, variants
        self._lock = threading.Lock()
        self._sorted: np.ndarray | None = None  # made at the first lesson, with the three below
        self._order: np.ndarray = _NONE
        self._offsets: np.ndarray = _NONE
        self._lengths: np.ndarray = _NONE

    @property
    def known(self) -> int:
        """Hints learned and not taken yet."""
        with self._lock:
            return 0 if self._sorted is None else int((self._offsets >= 0).sum())

    def take(self, key: bytes) -> Extent | None:
        """The learned extent of ``key`` (forgotten once taken), or None."""
        if len(key) != KEY_BYTES or not key.startswith(self._prefix):
            return None
        with self._lock:
            at = -1 if self._sorted is None else int(self._positions([key])[0])
        return None if at < 0 else self.take_range(at, at + 1)[0]

    def take_range(self, start: int, stop: int) -> list[Extent | None]:
        """``take`` of the schedule's positions ``start..stop-1`` at once."""
        with self._lock:
            if self._sorted is None:
                return [None] * (stop - start)
            offsets, lengths = self._offsets[start:stop].tolist(), self._lengths[start:stop].tolist()
            self._offsets[start:stop] = -1
        return [Extent(o, n) if o >= 0 else None for o, n in zip(offsets, lengths)]

    def learn(self, extents: list[tuple[bytes, Extent]]) -> None:
        mine = [(key, extent) for key, extent in extents if len(key) == KEY_BYTES and key.startswith(self._prefix)]
        if not mine or not len(self._ids):
            return
        with self._lock:
            if self._sorted is None:
                self._order = np.argsort(self._ids, kind="stable")
                self._sorted = self._ids[self._order]
                self._offsets = np.full(len(self._ids), -1, np.int64)
                self._lengths = np.zeros(len(self._ids), np.uint32)
            at = self._positions([key for key, _ in mine])
            for i, (_, extent) in zip(at.tolist(), mine):
                if i >= 0:
                    self._offsets[i], self._lengths[i] = extent.offset, extent.length

    def _positions(self, keys: list[bytes]) -> np.ndarray:
        """Each key's position in the schedule (-1: not in it); the keys have the group's prefix."""
        assert self._sorted is not None, "a position is asked only once a lesson sorted the schedule"
        ids, variants = sample_ids_of(keys)
        found = np.minimum(np.searchsorted(self._sorted, ids), len(self._sorted) - 1)
        at = self._order[found]
        mine = self._sorted[found] == ids
        mine &= (variants == 0) if self._variants is None else (self._variants[at] == variants)
        return np.where(mine, at, -1)


class ReadSession:
    """Lookups and reads inside one read transaction (``buffers=True``); one thread at a time.
    ``explicit=False`` copies every value out of the map; with a ``guess``, so does a warm reader."""

    def __init__(self, txn, file: ValueFile, *, explicit: bool = True, guess: PageCacheGuess | None = None) -> None:
        self._txn = txn
        self._cursor = txn.cursor()
        self._file = file
        self._explicit = explicit
        self._guess = guess
        self.explicit_reads = 0
        self.fallback_reads = 0
        self.cached_copies = 0  # values copied out of the map because they were in the page cache
        #: Whether the last ``read`` came entirely from the page cache (None: unknown).
        self.last_resident: bool | None = None

    def locate(self, key: bytes) -> Extent | None:
        """Where the value of ``key`` is, or None if there is no such key."""
        if not self._cursor.set_key(key):
            return None
        if self._explicit:
            if self._guess is not None and self._guess.use_map():
                self.cached_copies += 1
            elif (extent := self._overflow(key)) is not None:
                return extent
        value = self._cursor.value()
        return Extent(-1, len(value), bytes(value))

    def _overflow(self, key: bytes) -> Extent | None:
        """The overflow extent of ``key``, on which the cursor sits; None if not recognized or inline."""
        node = self._file.pages.overflow_node(self._cursor, key)
        return None if node is None else Extent.at_page(*node, self._file.page_size)

    def locate_hinted(self, key: bytes, hints: ExtentHints) -> Extent | None:
        """``locate`` for read hints: a learned extent if there is one, else a lookup that teaches
        ``hints`` every value on the key's leaf page. None if there is no such key (as far as known)."""
        if (extent := hints.take(key)) is not None:
            return extent
        if not self._cursor.set_key(key):
            return None
        size = self._file.page_size
        hints.learn([(k, Extent.at_page(pgno, n, size)) for k, n, pgno in self._file.pages.leaf_nodes(self._cursor)
                     if pgno >= 0])
        extent = self._overflow(key)
        if extent is None:  # a small value inside its leaf, or a node not recognized
            return self.locate(key)
        hints.take(key)  # its own, learned with its page
        return extent

    def run_views(self, keys: list[bytes]) -> list[memoryview | None] | None:
        """The values of ``keys`` (None per missing key) as views into the map, valid while this session
        is open, in one LMDB call: on the plain path, and with explicit reads while the guess says they
        are in the page cache; None: read them one by one."""
        if self._explicit:
            guess = self._guess
            if guess is None or not guess.warm or guess.check_due(len(keys)) and not self._still_cached(guess, keys):
                return None
        found = dict(self._cursor.getmulti(keys))
        if self._explicit:
            self.cached_copies += len(found)
        return [found.get(key) for key in keys]

    def copy_run(self, keys: list[bytes]) -> list[bytes | None] | None:
        """``run_views`` copied out of the map."""
        views = self.run_views(keys)
        return None if views is None else [None if v is None else bytes(v) for v in views]

    def _still_cached(self, guess: PageCacheGuess, keys: list[bytes]) -> bool:
        """Whether the first stored value of ``keys`` is in the page cache (told to the guess)."""
        for key in keys:
            if self._cursor.set_key(key):
                extent = self._overflow(key)
                resident = True if extent is None else self._file.resident(extent)
                guess.saw(resident)
                return bool(resident)
        return True

    def read(self, key: bytes, extent: Extent) -> bytes | memoryview:
        """The bytes of ``extent`` (located in this session); falls back to a copy from the map."""
        if extent.inline is not None:
            self.last_resident = True
            return extent.inline
        data, self.last_resident = self._file.read(extent)
        if self._guess is not None:
            self._guess.saw(self.last_resident)
        if data is not None and len(data) == extent.length:
            self.explicit_reads += 1
            return data
        self.fallback_reads += 1
        value = self._txn.get(key)
        return b"" if value is None else bytes(value)
