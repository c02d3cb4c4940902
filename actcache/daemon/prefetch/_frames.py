"""The consumer side of one schedule reader: takes what is ready as one frame's entries at a time.

Once the stream is warm and unhinted the reader thread parks (``Handover``) and the consumer gets
``DirectRun``s: it reads values from the store itself, one LMDB call per frame, which beats reading
ahead for values in the page cache (docs/design/serving.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from actcache._proto import actcache_pb2 as pb
from actcache.daemon.prefetch._budget import MemoryBudget
from actcache.daemon.prefetch._readahead import FILL_BYTES, Handover, ReadAhead, ReaderState
from actcache.daemon.prefetch._served import ServedBatch, split_with
from actcache.errors import ActCacheError, InvalidRequest
from actcache.served import served_size, to_raw_entries_into

if TYPE_CHECKING:
    from actcache.daemon.store import Store

__all__ = ["DirectRun", "FrameTaker"]

log = logging.getLogger(__name__)

# A frame waits up to _LINGER_S for a frame's worth of ready entries (ReadAhead.frame_filled) rather
# than going out small.
_LINGER_S = 0.005
# Entries looked up to learn the entry size, which sizes the runs of a frame's worth.
_SIZE_PROBE = 8


class FrameTaker:
    """Hands one consumer (a Fetch) its stream as frames: ``ServedBatch``es of ready entries, or
    ``DirectRun``s once it has taken reading over (``Handover``).

    Runs on the consumer's thread only. Invariants: it moves ``served``
    forward only over ready positions, in order, under ``cond``; it waits for
    entries with ``consumer_waits`` set, so the reader wakes it only when
    that is there; a frame's budget bytes go back when the frame is finished
    (``ServedBatch.finish``), not when it is taken.
    """

    def __init__(self, shared: ReadAhead, handover: Handover, *, store: Store, budget: MemoryBudget,
                 decode_pool: Executor | None, key: Callable[[int], bytes], on_done: Callable[[], None]) -> None:
        """The budget counts the reader's bytes under ``shared``; ``on_done``: the stream is served."""
        self._schedule, self._shared, self._handover, self._store = handover.schedule, shared, handover, store
        self._budget, self._decode, self._key, self._on_done = budget, decode_pool, key, on_done

    def batches(self, max_frame_bytes: int, direct_entries: int) -> Iterator[ServedBatch | DirectRun]:
        """See ``ScheduleReader.batches``."""
        shared, handover = self._shared, self._handover
        # Over shared memory the client sizes frames to one batch (it needs all of it): fill them whole.
        shared.fill_bytes = max_frame_bytes if direct_entries else min(max_frame_bytes, FILL_BYTES)
        while True:
            direct_at = None
            with shared.cond:
                def over() -> bool:  # nothing more will become ready for this consumer
                    return (shared.state is ReaderState.CANCELLED or shared.served >= shared.end
                            or shared.state is ReaderState.FAILED and shared.served not in shared.slots)

                def filled() -> bool:  # a frame's worth is ready, or no more is coming soon
                    return (shared.frame_filled() or over() or handover.parked  # parked: this consumer reads on
                            or shared.state is not ReaderState.READING and shared.ready >= min(shared.read, shared.end))

                stalled, waited = False, 0.0
                handover.claim(direct_entries)
                if shared.served == shared.ready and not over() and not handover.parked:
                    stalled, t0 = True, time.monotonic()
                    shared.consumer_waits = "any"
                    shared.cond.wait_for(lambda: shared.served < shared.ready or over() or handover.parked)
                    waited = time.monotonic() - t0
                if handover.parked and shared.served == shared.ready and not over():
                    direct_at = shared.served
                else:
                    if not filled():
                        # Less than a frame is ready: rather than a small frame (costly on both sides),
                        # give the reader a moment to fill a reasonable one.
                        shared.consumer_waits = "fill"
                        shared.cond.wait_for(filled, _LINGER_S)
                    if shared.served == shared.ready:
                        shared.consumer_waits = None
                        if shared.state in (ReaderState.CANCELLED, ReaderState.FAILED):
                            if shared.error is not None:
                                raise shared.error
                            return
                        shared.set_state(ReaderState.DONE)
                        break
                    start, taken = shared.take(max_frame_bytes)
                shared.consumer_waits = None
                if shared.reader_waits:
                    shared.cond.notify_all()
            if direct_at is not None:
                yield DirectRun(direct_at, min(shared.end, direct_at + direct_entries), handover, key=self._key,
                                store=self._store, discard=self.discard_corrupt, pool=self._decode)
                continue
            counts = dict(ready_on_ask=len(taken) - stalled, stalls=int(stalled), stall_seconds=waited)
            batch = ServedBatch(self._schedule.header(start, [s.nbytes for s in taken]), [s.data for s in taken],
                                pool=self._decode, discard=self.discard_corrupt,
                                done=functools.partial(self._served_done, sum(s.held for s in taken)), counts=counts)
            try:
                yield batch
            finally:
                batch.finish()
        self._on_done()

    def _served_done(self, held: int, counts: dict) -> None:
        """What a served frame calls once: give back its ``held`` budget bytes and count it."""
        self._budget.release(self._shared, held)
        self._schedule.counters.add(**counts)

    def discard_corrupt(self, pos: int, exc: InvalidRequest) -> None:
        """Position ``pos`` failed verification: it is served as a miss; delete it from the store."""
        log.warning("schedule %r position %d: stored entry is corrupt (%s); serving a miss and deleting it",
                    self._schedule.schedule_id, pos, exc)
        try:
            self._store.discard_corrupt(self._schedule.keys(pos, pos + 1))
        except ActCacheError as delete_error:
            log.warning("could not delete the corrupt entry: %s", delete_error)


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

    def split(self, sizes: Sequence[int], run: Callable[[range], None]) -> None:
        """``run`` over the indices of ``sizes`` (bytes each), the decode pool taking half of a large run
        (copies and checksums release the interpreter lock)."""
        split_with(self._pool, range(len(sizes)), sizes, run)

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
