"""One schedule reader: reads a pushed order ahead of its consumer and serves it as Fetch frames.

Threads: the reader's own thread walks the order (``ReadLoop``), the probe
pool looks up ahead (``_lookahead``), and the consumer's gRPC thread
(``FrameTaker``) decodes each frame with the decode pool's help. A warm
stream over shared memory is read by the consumer itself (``Handover``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Callable, Iterator

from actcache.daemon.prefetch._budget import MemoryBudget
from actcache.daemon.prefetch._frames import DirectRun, FrameTaker
from actcache.daemon.prefetch._read_loop import ReadLoop
from actcache.daemon.prefetch._readahead import Handover, ReadAhead, ReaderSnapshot, ReaderState, Stop
from actcache.daemon.prefetch._schedule import Schedule
from actcache.daemon.prefetch._served import ServedBatch
from actcache.daemon.store import PageCacheGuess
from actcache.errors import ActCacheError, StoreError
from actcache.rpc import encode_frame

if TYPE_CHECKING:
    from actcache.daemon.store import Store

__all__ = ["DirectRun", "ReaderSnapshot", "ReaderState", "ScheduleReader", "ServedBatch"]

log = logging.getLogger(__name__)


class ScheduleReader(ReadAhead):
    """Reads ``schedule`` from ``start`` ahead of the consumer within the shared budget: the stream's
    ``ReadAhead``, its reader thread, its consumer's frames and the hand-over between them.

    Invariants (see ``ReadAhead``): the budget bytes it holds are its slots'
    plus at most one reservation for the entry being read, so the budget
    bounds its memory; a slot is dropped once its frame is built, every slot
    at once when cancelled.
    """

    def __init__(self, schedule: Schedule, start: int, *, store: Store, budget: MemoryBudget,
                 decode_pool: Executor | None, probe_pool: Executor | None, probe_bytes: int, attached: bool,
                 on_change: Callable[[ScheduleReader], None], on_starved: Callable[[ScheduleReader, int], None],
                 guess: PageCacheGuess) -> None:
        """``guess``: whether this stream's values are in the page cache (kept per group by the prefetcher)."""
        super().__init__(len(schedule), start, attached=attached)
        self.schedule, self._budget, self._on_change = schedule, budget, on_change
        self._handover = handover = Handover(self, schedule, guess, explicit_reads=store.config.explicit_reads,
                                             on_read_all=lambda: on_change(self))
        self._loop = ReadLoop(self, handover, store=store, budget=budget, probe_pool=probe_pool,
                              probe_bytes=probe_bytes, on_starved=on_starved)
        self._frames = FrameTaker(self, handover, store=store, budget=budget, decode_pool=decode_pool,
                                  key=self._loop.key, on_done=lambda: on_change(self))
        self._thread: threading.Thread | None = None  # runs the reading loop (``begin``)

    def begin(self) -> None:
        """Start reading, on a thread of its own."""
        self._thread = threading.Thread(target=self._run, name=f"actcache-reader-{self.schedule.schedule_id}",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reading thread; one that ``begin`` has not started yet (a push racing a close) is
        not waited for: it starts cancelled and ends at once."""
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def cancel(self, error: ActCacheError | None = None) -> None:
        """End the reader (a failed one too) and free its ready entries now; ``error`` goes to a consumer
        still listening, None ends its stream quietly."""
        self._ended(self.end_reading(error))

    def _fail(self, exc: BaseException) -> None:
        """End reading with ``exc``: the consumer still gets the entries read so far, then the error."""
        if isinstance(exc, ActCacheError):
            error = exc
        else:
            log.error("schedule reader failed", exc_info=exc)
            error = StoreError(
                f"reading schedule {self.schedule.schedule_id!r} failed at position {self.read}: {exc!r}")
        self._ended(self.end_reading(error, self.read))

    def _ended(self, freed: int | None) -> None:
        """Give back the bytes an ending freed and tell the prefetcher (None: it had ended already)."""
        if freed is None:
            return
        self._budget.release(self, freed)
        self._on_change(self)
        self._budget.wake()

    def snapshot(self) -> ReaderSnapshot:
        with self.cond:
            return ReaderSnapshot(self.state, self.attached, self.start, self.served, self.ready, self.read,
                                  len(self.schedule), self._budget.held(self))

    def _run(self) -> None:
        try:
            with self._budget.cond:
                self._budget.cond.wait_for(lambda: self.stopping or self.allowed)
            with self.cond:
                if self.stopping:
                    return
                self.set_state(ReaderState.READING)
            self._on_change(self)
            self._loop.read_all()
            with self.cond:
                if self.state is ReaderState.READING:
                    self.set_state(ReaderState.READ_ALL)
            self._on_change(self)
        except Stop:
            return  # cancelled, or failed and already ended by _fail
        except BaseException as exc:  # delivered to the consumer, never a silent stall
            self._fail(exc)

    def frames(self, max_frame_bytes: int) -> Iterator[bytes]:
        """Fetch frames (entries in the payload) from ``start`` to the end; see ``batches``."""
        for batch in self.batches(max_frame_bytes):
            assert isinstance(batch, ServedBatch), "no DirectRun without direct_entries"
            parts = batch.decode()
            frame = encode_frame(batch.header.SerializeToString(), [p for entry in parts for p in entry])
            batch.finish()
            yield frame

    def batches(self, max_frame_bytes: int, *, direct_entries: int = 0) -> Iterator[ServedBatch | DirectRun]:
        """The entries of one frame at a time, from ``start`` to the end.

        The consumer decodes them (``decode`` or ``decode_into``), then calls
        ``finish()`` (releases their budget bytes and counts them; closing the
        generator does it too). Raises the reader's error after the entries
        read before it; returns early if cancelled without an error.

        ``direct_entries``: once the stream is warm, after what was read
        ahead the consumer gets ``DirectRun``s of up to that many positions
        to read from the store itself (_frames.py), until it gives reading
        back (``DirectRun.give_back``) or the generator ends.
        """
        try:
            yield from self._frames.batches(max_frame_bytes, direct_entries)
        finally:
            self._handover.release()
