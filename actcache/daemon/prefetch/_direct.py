"""Direct runs: positions of a warm stream that the consumer reads from the store itself, one pass per frame.

Why: for values in the page cache, one thread that looks a frame's keys up
in one LMDB call and copies each value straight into its ring slot beats
reading ahead (docs/design/serving.md).

How: once the stream is warm and unhinted the reader thread parks
(``Handover``); after what it read ahead, the consumer gets ``DirectRun``s:
a short read transaction (``values``) closed before it sends or waits, then
``done``, or ``give_back`` to the reader thread when the values seem cold.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Callable, Iterator

from actcache._proto import actcache_pb2 as pb
from actcache.daemon.prefetch._served import split_with
from actcache.served import served_size, to_raw_entries_into
from actcache.errors import InvalidRequest

if TYPE_CHECKING:
        from actcache.daemon.store import Store

__all__ = ["DirectRun"]

# Entries looked up to learn the entry size, which sizes the runs of a frame's worth.
_SIZE_PROBE = 8


class DirectRun:
    """Positions ``start`` to ``stop`` of a stream, to be read by the consumer from the store: it
    serves a prefix of them (``done``), the next run starts after it."""

    __slots__ = ("start", "stop", "_handover", "_key", "_store", "_discard", "_pool")

    def __init__(self, start: int, stop: int, handover: Handover, *, key: Callable[[int], bytes], store: Store,
                 discard: Callable[[int, InvalidRequest], None], pool: Executor | None) -> None:
        """``discard(position, error)`` deletes a corrupt entry; ``pool``: the decode pool."""
        self.start, self.stop, self._handover, self._key = start, stop, handover, key
        self._store, self._discard, self._pool = store, discard, pool

    @contextlib.contextmanager
    def values(self, count: int) -> Iterator[list[memoryview | None] | None]:
        """The values of the run's first ``count`` positions as views into LMDB's map (None: absent),
        valid inside the block (a read transaction: no waiting inside it); None if they no longer seem
        to be in the page cache."""
        keys = [self._key(p) for p in range(self.start, min(self.stop, self.start + count))]
        with self._store.read_session(self._handover.guess) as session:
            yield session.run_views(keys)

    def decode_into(self, values: list, outs: list[memoryview]) -> list[InvalidRequest | None]:
        """``to_raw_entries_into(values, outs)``, the decode pool taking half of a large run (decompressing
        releases the interpreter lock)."""
        errors: list[InvalidRequest | None] = [None] * len(values)

        def run(part: range) -> None:
            errors[part.start : part.stop] = to_raw_entries_into(values[part.start : part.stop],
                                                                 outs[part.start : part.stop])

        split_with(self._pool, range(len(values)), [out.nbytes for out in outs], run)
        return errors

    def entry_size(self) -> int:
        """The served size of the first stored entry among the run's first few (0: none stored)."""
        with self.values(_SIZE_PROBE) as views:
            return next((served_size(v) for v in views or () if v is not None), 0)

    def header(self, lengths: list[int]) -> pb.EntriesHeader:
        """The frame header of the run's first ``len(lengths)`` positions."""
        return self._handover.schedule.header(self.start, lengths)

    def done(self, lengths: list[int], corrupt: list[tuple[int, InvalidRequest]]) -> None:
        """The first ``len(lengths)`` positions were served with these sizes (0: a miss); ``corrupt``
        (run index, error): entries that failed verification, to delete (their lengths are 0). Once."""
        for i, exc in corrupt:
            self._discard(self.start + i, exc)
        hits = sum(1 for n in lengths if n)
        served = sum(lengths)
        self._handover.done(self.start, len(lengths), dict(
            hits=hits, misses=len(lengths) - hits, corrupt=len(corrupt), ready_on_ask=len(lengths),
            read_bytes=served, served_bytes=served, direct=len(lengths)))

    def give_back(self) -> None:
        """Let the reader thread read ahead again, from this run's start (the values seem cold, or the
        entry there needs the regular path); no direct run is offered before it has read past it."""
        self._handover.give_back(self.start)
