"""Helpers of a schedule reader for reading ahead: probes for cold data, and short read transactions.

Why probes stay: without them explicit reads served cold data at about a third of the speed
(docs/design/serving.md).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Callable

from actcache.daemon.store import ExtentHints, PageCacheGuess

if TYPE_CHECKING:
    from actcache.daemon.store import ReadSession, Store

__all__ = ["INLINE_PROBE_AHEAD", "MIN_PROBED_ENTRY_BYTES", "Prober", "ShortTransaction"]

_WARM_STREAK = 128
# Entries looked up by one probe task (one read transaction).
_PROBE_BATCH = 8
# Entries of at least this size (stored bytes, on average) are probed on the probe pool, where the
# reader's own WILLNEED calls would block on a full disk queue; smaller ones from the reader's own
# thread (INLINE_PROBE_AHEAD entries ahead until the entry size is known, then the pool's window).
MIN_PROBED_ENTRY_BYTES = 1 << 20
INLINE_PROBE_AHEAD = 64
_SESSION_ENTRIES = 256
_SESSION_SECONDS = 0.05


class Prober:
    """Lookups ahead of one reader while its data is cold: on the probe pool, or for small entries
    from the reader's own thread (see MIN_PROBED_ENTRY_BYTES).

    A probe hints the kernel to read the values not in the page cache, so the
    disk sees many reads at once instead of the reader's one at a time; the
    probes share an ``ExtentHints`` (one lookup per B-tree leaf page). Probing
    pauses after ``_WARM_STREAK`` entries in a row needed no hint (probes then
    only cost CPU) and resumes as soon as a read had to wait for the disk.
    """

    def __init__(self, pool: Executor, probe: Callable[[list[bytes], ExtentHints | None, int], list[bool | None]],
                 key: Callable[[int], bytes], length: int, window_bytes: int, *, paused: bool = False,
                 hints: ExtentHints | None = None) -> None:
        """``paused``: start as after a warm streak (the group's last schedule ended warm)."""
        self._pool, self._probe, self._key, self._hints = pool, probe, key, hints
        self._length, self._window_bytes = length, window_bytes
        self._pending: deque[tuple[int, int, Future]] = deque()  # (first, stop, future)
        self._streak, self.active = 0, not paused
        self._inline_end = 0  # entries before this were probed from the reader's thread

    def advance(self, pos: int, avg_bytes: int) -> None:
        """The reader is at ``pos`` (entries so far: ``avg_bytes`` each, 0 = none read yet): collect the
        probes it passed, keep the window ahead filled."""
        while self._pending and self._pending[0][1] <= pos:
            first, stop, future = self._pending.popleft()
            if future.done() and not future.cancelled() and future.exception() is None:
                for resident in future.result():
                    self._note(resident is not False)
            else:
                future.cancel()
                self._note(True, stop - first)  # the reader passed first; saw_read reports cold reads
        if not self.active:
            return
        window = max(8, min(1024, self._window_bytes // avg_bytes)) if avg_bytes else INLINE_PROBE_AHEAD
        if avg_bytes < MIN_PROBED_ENTRY_BYTES:  # small entries, or none read yet
            self._probe_inline(pos, window)
            return
        start = self._pending[-1][1] if self._pending else pos + 1
        end = min(self._length, pos + 1 + window)
        while start < end:
            stop = min(end, start + _PROBE_BATCH)
            keys = [self._key(p) for p in range(start, stop)]
            self._pending.append((start, stop, self._pool.submit(self._probe, keys, self._hints, start)))
            start = stop

    def _probe_inline(self, pos: int, window: int) -> None:
        """Probe up to ``window`` entries past ``pos`` in this thread, half a window at a time."""
        if pos + window // 2 < self._inline_end:
            return
        start, end = max(pos + 1, self._inline_end), min(self._length, pos + 1 + window)
        if start < end:
            for resident in self._probe([self._key(p) for p in range(start, end)], self._hints, start):
                self._note(resident is not False)
        self._inline_end = end

    def _note(self, warm: bool, count: int = 1) -> None:
        if not warm:
            self._streak = 0
            return
        self._streak += count
        if self._streak >= _WARM_STREAK:
            self.active = False
            self.close()

    def saw_read(self, resident: bool | None) -> None:
        """The reader read an entry; one that was not cached restarts probing."""
        if not resident:
            self._streak = 0
            self.active = True

    def close(self) -> None:
        for _, _, future in self._pending:
            future.cancel()
        self._pending.clear()


class ShortTransaction:
    """A read transaction opened lazily and closed every ``_SESSION_ENTRIES`` entries or
    ``_SESSION_SECONDS`` (and by the caller before any wait), so it never pins pages, or holds off a
    map resize, for long."""

    def __init__(self, store: Store, guess: PageCacheGuess) -> None:
        self._store, self._guess = store, guess  # the guess outlives the transactions
        self._cm: contextlib.AbstractContextManager[ReadSession] | None = None
        self._session: ReadSession | None = None
        self._opened_at, self._entries = 0.0, 0

    def open(self) -> ReadSession:
        if self._session is None:
            self._cm = cm = self._store.read_session(self._guess)
            self._session = cm.__enter__()
            self._opened_at, self._entries = time.monotonic(), 0
        return self._session

    def is_open(self, session) -> bool:
        return session is self._session

    def tick(self, entries: int = 1) -> None:
        self._entries += entries
        if self._entries >= _SESSION_ENTRIES or time.monotonic() - self._opened_at > _SESSION_SECONDS:
            self.close()

    def close(self) -> None:
        if self._cm is not None:
            cm, self._cm, self._session = self._cm, None, None
            cm.__exit__(None, None, None)
