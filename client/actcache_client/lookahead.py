"""Look up the epoch's next batches on a background thread, so the step rarely waits on the daemon.

The loader hands over the epoch's batches (the sampler's order for this
rank); the thread fetches the entries of the next ``window`` batches for the
current (fingerprint, depth) and the step takes them in order.

Invariants: taken <= fetched <= taken + window; a batch's entries are
dropped once taken; a retarget (freeze change) or a new epoch discards
everything fetched. The thread waits on a condition, never polls.
"""

from __future__ import annotations

import threading
from typing import Sequence

from actcache_client.connection import Connection
from actcache_client.cost_model import cached_subset

__all__ = ["Lookahead"]


class Lookahead:
    """Background lookups of upcoming batches, taken by the training step in order."""

    def __init__(self, connection: Connection, window: int = 2) -> None:
        if window < 1:
            raise ValueError(f"lookahead window must be >= 1 batch, got {window}")
        self._connection = connection
        self._window = window
        self._cond = threading.Condition()
        self._batches: list[tuple[int, ...]] = []
        self._variant = 0
        self._target: tuple[bytes, int] | None = None
        self._fraction = 1.0
        self._generation = 0
        self._taken = 0  # next position the step will take
        self._fetched = 0  # next position the thread will fetch
        self._ready: dict[int, list | Exception | None] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="actcache-lookahead", daemon=True)
        self._thread.start()

    def retarget(self, fingerprint: bytes, depth: int, fraction: float = 1.0) -> None:
        """Look up entries at (fingerprint, depth) from now on (depth 0: nothing), for the cached subset."""
        with self._cond:
            self._target = (fingerprint, depth) if depth > 0 else None
            self._fraction = fraction
            self._reset(self._taken)

    def begin_epoch(self, batches: Sequence[Sequence[int]], variant: int, start: int = 0) -> None:
        with self._cond:
            self._batches = [tuple(b) for b in batches]
            self._variant = variant
            self._reset(start)

    def _reset(self, position: int) -> None:
        self._generation += 1
        self._taken = self._fetched = position
        self._ready.clear()
        self._cond.notify_all()

    def take(self, fingerprint: bytes, depth: int, ids: Sequence[int], variant: int) -> list | None:
        """Entries of the next batch if it is the one expected, else None (the caller looks up itself)."""
        key = tuple(ids)
        with self._cond:
            position = self._taken
            expected = (
                self._target == (fingerprint, depth)
                and variant == self._variant
                and position < len(self._batches)
                and self._subset(self._batches[position]) == key
            )
            if not expected:
                return None
            self._cond.wait_for(lambda: position in self._ready or self._taken != position or self._closed)
            values = self._ready.pop(position, None)
            if self._taken == position:
                self._taken += 1
                self._cond.notify_all()
        if isinstance(values, Exception):
            raise values
        return values

    def _subset(self, batch: tuple[int, ...]) -> tuple[int, ...]:
        if self._fraction >= 1.0:
            return batch
        return tuple(s for s in batch if cached_subset(s, self._fraction))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed
                    or (
                        self._target is not None
                        and self._fetched < len(self._batches)
                        and self._fetched < self._taken + self._window
                    )
                )
                if self._closed:
                    return
                position, generation = self._fetched, self._generation
                ids, variant, (fingerprint, depth) = self._subset(self._batches[position]), self._variant, self._target
                self._fetched += 1
            try:
                values = self._connection.lookup(fingerprint, depth, list(ids), [variant] * len(ids))
            except Exception as exc:  # strict mode: delivered to the step that takes this batch
                values = exc
            with self._cond:
                if generation == self._generation and position >= self._taken:
                    self._ready[position] = values
                    self._cond.notify_all()
