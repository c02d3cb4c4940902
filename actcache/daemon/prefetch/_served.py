"""One Fetch frame's entries taken from a schedule reader, and their decoding as they are served.

The Fetch thread verifies and decompresses the stored entries into the frame
or the shared-memory slots, the decode pool taking part of a large frame; an
entry that fails verification becomes a miss and is deleted from the store.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Callable, Sequence

from actcache._proto import actcache_pb2 as pb
from actcache.codec import EntryHeader
from actcache.errors import InvalidRequest
from actcache.served import copy_raw_columns, to_raw_entries, to_raw_entries_into

__all__ = ["ServedBatch", "split_with"]

# A frame's entries are split with the decode pool from this many decoded bytes on.
_SPLIT_BYTES = 256 << 10


class ServedBatch:
    """One frame's entries taken from a reader, as stored (None = a miss); ``header.lengths[i]`` is
    entry i's size as served, set to 0 (a miss) when it fails verification."""

    __slots__ = ("header", "stored", "_pool", "_discard", "_done", "_counts", "_failed")

    def __init__(self, header: pb.EntriesHeader, stored: list, *, pool: Executor | None,
                 discard: Callable[[int, InvalidRequest], None], done: Callable[[dict], None], counts: dict) -> None:
        """``discard(position, error)`` deletes a corrupt entry; ``done(counts)`` releases the entries' memory
        and adds ``counts`` (``counts`` given here plus hits, misses, corrupt and served bytes)."""
        self.header, self.stored = header, stored
        self._pool, self._discard, self._done = pool, discard, done
        self._counts: dict | None = counts  # None once finished
        self._failed: list[int] = []  # entries that failed verification (list.append is thread-safe)

    @property
    def nbytes(self) -> int:
        return sum(self.header.lengths)

    def decode(self, indices: range | None = None) -> list[tuple]:
        """Entries ``indices`` (default: all) as the parts of their served form (() for a miss)."""
        indices = range(len(self.stored)) if indices is None else indices
        out: list[tuple] = [()] * len(indices)

        def run(part: range) -> None:
            todo = [i for i in part if self.stored[i] is not None]
            for i, parts in zip(todo, to_raw_entries([self.stored[i] for i in todo])):
                if isinstance(parts, InvalidRequest):
                    self._fail_entry(i, parts)
                else:
                    out[i - indices.start] = parts

        split_with(self._pool, indices, self.header.lengths, run)
        return out

    def decode_into(self, indices: range, outputs: list[memoryview | None]) -> None:
        """Decode entries ``indices`` into ``outputs`` (one per index: ``header.lengths[i]`` bytes,
        None for a miss)."""

        def run(part: range) -> None:
            todo = [(i, out) for i in part if (out := outputs[i - indices.start]) is not None]
            errors = to_raw_entries_into([self.stored[i] for i, _ in todo], [out for _, out in todo])
            for (i, _), exc in zip(todo, errors):
                if exc is not None:
                    self._fail_entry(i, exc)

        split_with(self._pool, indices, self.header.lengths, run)

    def copy_columns(self, layout: EntryHeader, columns: list[memoryview]) -> None:
        """Copy the entries (all present, raw, of ``layout``) into ``columns`` (``copy_raw_columns``)."""
        for i, exc in enumerate(copy_raw_columns(self.stored, layout, columns)):
            if exc is not None:
                self._fail_entry(i, exc)

    def _fail_entry(self, i: int, exc: InvalidRequest) -> None:
        self.header.lengths[i] = 0
        self._failed.append(i)
        self._discard(self.header.start + i, exc)

    def finish(self) -> None:
        """Release the entries' budget bytes and count them as served (once)."""
        if self._counts is None:
            return
        counts, self._counts = self._counts, None
        lengths = self.header.lengths
        hits = sum(1 for n in lengths if n)
        self._done(dict(counts, hits=hits, misses=len(lengths) - hits, corrupt=len(self._failed),
                        served_bytes=sum(lengths)))


def split_with(pool: Executor | None, indices: range, sizes: Sequence[int], run: Callable[[range], None]) -> None:
    """``run(indices)``, with ``pool`` taking the second half (by ``sizes[i]`` bytes) of a large run."""
    total = sum(sizes[i] for i in indices)
    if pool is None or total < _SPLIT_BYTES or len(indices) < 2:
        run(indices)
        return
    half, mid = 0, indices.start
    while mid < indices.stop - 1 and half < total // 2:
        half += sizes[mid]
        mid += 1
    try:
        future = pool.submit(run, range(mid, indices.stop))
    except RuntimeError:  # the pool is shut down: the daemon is stopping
        run(indices)
        return
    run(range(indices.start, mid))
    future.result()
