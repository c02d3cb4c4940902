"""The prefetch memory budget: bytes of read-ahead entries, shared fairly among schedule readers.

Invariants, under ``cond``: ``0 <= used <= limit == sum of the holders'
bytes``; a holder (a schedule reader) is granted ``n`` bytes only while
active (the prefetcher decides) and ``used + n <= limit``, and within its
fair share (``limit // active holders``) unless it holds nothing (a large
entry still makes progress); while any holder waits ``first`` (its consumer
waits), others get nothing, so bytes given back go to it; ``max_used`` is
the highest ``used`` seen. The same condition guards the prefetcher's
registry, so one ``notify_all`` wakes everything that may proceed.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

__all__ = ["MemoryBudget"]


class MemoryBudget:
    """A byte budget with fair shares; blocking acquisition waits on a condition."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cond = threading.Condition()
        self.used = 0
        self.max_used = 0
        self._held: dict[Hashable, int] = {}
        self._active: set[Hashable] = set()
        self._first: dict[Hashable, int] = {}  # holders waiting first -> how many waits

    def set_active(self, holder: Hashable, active: bool) -> None:
        """Mark ``holder`` as allowed to acquire (or not). Caller holds ``cond``."""
        if active:
            self._active.add(holder)
        else:
            self._active.discard(holder)

    def held(self, holder: Hashable) -> int:
        with self.cond:
            return self._held.get(holder, 0)

    def _fits(self, holder: Hashable, n: int) -> bool:
        if holder not in self._active or self.used + n > self.limit:
            return False
        if self._first and holder not in self._first:
            return False
        mine = self._held.get(holder, 0)
        return mine == 0 or mine + n <= self.limit // len(self._active)

    def _take(self, holder: Hashable, n: int) -> bool:
        if not self._fits(holder, n):
            return False
        self._held[holder] = self._held.get(holder, 0) + n
        self.used += n
        self.max_used = max(self.max_used, self.used)
        return True

    def try_acquire(self, holder: Hashable, n: int) -> bool:
        """Take ``n`` bytes if that fits now; never blocks."""
        with self.cond:
            return self._take(holder, n)

    def acquire(self, holder: Hashable, n: int, stop: Callable[[], bool]) -> bool:
        """Wait until ``n`` bytes fit and take them; False (nothing taken) once ``stop()`` is true."""
        with self.cond:
            self.cond.wait_for(lambda: stop() or self._fits(holder, n))
            return not stop() and self._take(holder, n)

    @contextmanager
    def first(self, holder: Hashable) -> Iterator[None]:
        """Within this block ``holder`` waits first: holders outside any ``first`` block get nothing meanwhile."""
        with self.cond:
            self._first[holder] = self._first.get(holder, 0) + 1
        try:
            yield
        finally:
            with self.cond:
                self._first[holder] -= 1
                if not self._first[holder]:
                    del self._first[holder]
                self.cond.notify_all()

    def release(self, holder: Hashable, n: int) -> None:
        """Give back ``n`` of ``holder``'s bytes and wake the waiters."""
        if n <= 0:
            return
        with self.cond:
            mine = self._held.get(holder, 0)
            if n > mine:
                raise AssertionError(f"releasing {n} bytes but the holder has {mine}")
            self._held[holder] = mine - n
            if mine == n:
                del self._held[holder]
            self.used -= n
            self.cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter to re-check its condition (after a state change elsewhere)."""
        with self.cond:
            self.cond.notify_all()
