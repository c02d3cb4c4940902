"""The consumer side of one schedule reader: takes what is ready as one frame's entries at a time."""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Callable, Iterator

from actcache.daemon.prefetch._budget import MemoryBudget
from actcache.daemon.prefetch._direct import DirectRun
from actcache.daemon.prefetch._readahead import FILL_BYTES, Handover, ReadAhead, ReaderState
from actcache.daemon.prefetch._served import ServedBatch
from actcache.errors import ActCacheError, InvalidRequest

if TYPE_CHECKING:
    from actcache.daemon.store import Store

__all__ = ["FrameTaker"]

log = logging.getLogger(__name__)

# A frame waits up to _LINGER_S for a frame's worth of ready entries (ReadAhead.frame_filled) rather
# than going out small.
_LINGER_S = 0.005


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
