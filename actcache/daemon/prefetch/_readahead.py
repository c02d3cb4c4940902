"""What one schedule reader shares with its consumer: the lifecycle, the positions, the entries read ahead,
and who reads (the hand-over of a warm stream's reading to its consumer and back).

Lifecycle (ReaderState)::

    WAITING --> READING --> READ_ALL --> DONE
       |           |           |
       +-----------+-----------+--> CANCELLED   consumer gone, schedule replaced,
                   |           |                newer Fetch, daemon stopping
                   +-----------+--> FAILED      the store failed; the consumer gets
                                                the error after the entries read before it
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from actcache.errors import ActCacheError

if TYPE_CHECKING:
    from actcache.daemon.prefetch._schedule import Schedule
    from actcache.daemon.store import PageCacheGuess

__all__ = ["ENDED", "FILL_BYTES", "MAX_AHEAD_ENTRIES", "Handover", "ReadAhead", "ReaderSnapshot", "ReaderState", "Slot",
           "Stop"]

# Entries a reader keeps read ahead of its consumer at most (misses hold no budget bytes).
MAX_AHEAD_ENTRIES = 1 << 16
# A frame is filled when this many bytes (or FILL_ENTRIES entries) are ready: every frame costs a gRPC
# message and wake-ups on both sides, whatever it holds.
FILL_BYTES = 1 << 20
FILL_ENTRIES = 1024


class ReaderState(enum.Enum):
    WAITING = "waiting"
    READING = "reading"
    READ_ALL = "read_all"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


ENDED = (ReaderState.DONE, ReaderState.CANCELLED, ReaderState.FAILED)


@dataclass(frozen=True, slots=True)
class ReaderSnapshot:
    """Positions and memory of a reader at one instant (start <= served <= ready <= read <= length)."""

    state: ReaderState
    attached: bool
    start: int
    served: int
    ready: int
    read: int
    length: int
    buffered_bytes: int

    @property
    def read_ahead_entries(self) -> int:
        return self.read - self.served


class Slot(NamedTuple):
    """One read position: the entry as stored (None = a miss), its budget bytes, its size as served."""

    held: int = 0
    data: object = None
    nbytes: int = 0


class Stop(Exception):
    """The reader was cancelled or failed; its thread ends."""


class ReadAhead:
    """The state one stream's reader thread, its consumer and the prefetcher share, under ``cond``.

    Invariants (under ``cond``): ``start <= served <= ready <= read <=
    len(schedule)``, ``read - served <= MAX_AHEAD_ENTRIES``; positions in
    ``[served, read)`` have a slot; ``ready == read`` while reading (a
    failure moves ``ready`` back to ``end``, where serving ends);
    ``ready_bytes`` is the served size of ``[served, ready)``; once
    ``stopping`` nothing more is published. Wake-ups: ``publish`` wakes the
    consumer only when what it waits for (``consumer_waits``) is there, the
    consumer wakes the reader only when it waits (``reader_waits``), every
    state change wakes both. ``attached``, ``allowed`` and ``reclaimed`` are
    set by the prefetcher under the budget's condition.
    """

    def __init__(self, length: int, start: int, *, attached: bool) -> None:
        self.cond = threading.Condition()
        self.state = ReaderState.WAITING
        self.start = start
        self.served = self.ready = self.read = start
        #: Positions from here on are never served (the length, or where the reader failed).
        self.end = length
        self.slots: dict[int, Slot] = {}
        self.ready_bytes = 0
        self.reader_waits = False  # the reader waits for the consumer (MAX_AHEAD_ENTRIES)
        #: What the consumer waits for: None (not waiting), "any" ready entry, or a frame's "fill".
        self.consumer_waits: str | None = None
        self.fill_bytes = FILL_BYTES
        self.error: ActCacheError | None = None
        self.stopping = False
        #: A Fetch consumes this stream.
        self.attached = attached
        #: May the reader read now?
        self.allowed = attached
        #: Gave its bytes back to a starving consumer; never attached.
        self.reclaimed = False

    def set_state(self, state: ReaderState) -> None:
        """Caller holds ``cond``; the prefetcher is told after the lock is dropped."""
        self.state = state
        self.cond.notify_all()

    def frame_filled(self) -> bool:
        """A frame's worth is ready. Caller holds ``cond``."""
        return self.ready_bytes >= self.fill_bytes or self.ready - self.served >= FILL_ENTRIES

    def publish(self, start: int, slots: list[Slot]) -> bool:
        """Make ``slots`` the entries from ``start`` on, read and ready, under one lock; False (nothing
        published) once stopping."""
        with self.cond:
            if self.stopping:
                return False
            for pos, slot in enumerate(slots, start=start):
                self.slots[pos] = slot
                self.ready_bytes += slot.nbytes
            self.read = self.ready = start + len(slots)
            # Wake the consumer only when what it waits for is there (a wake-up per entry costs more
            # CPU than the entry's decoding).
            if self.consumer_waits == "any" or self.consumer_waits == "fill" and self.frame_filled():
                self.cond.notify_all()
        return True

    def take(self, max_frame_bytes: int) -> tuple[int, list[Slot]]:
        """The ready slots of one frame (at least one, at most ``max_frame_bytes`` beyond the first), now
        served. Caller holds ``cond``; ``served < ready``."""
        start, size = self.served, 0
        taken: list[Slot] = []
        while self.served < self.ready:
            slot = self.slots[self.served]
            if taken and size + slot.nbytes > max_frame_bytes:
                break
            taken.append(self.slots.pop(self.served))
            size += slot.nbytes
            self.served += 1
        self.ready_bytes -= size
        return start, taken

    def end_reading(self, error: ActCacheError | None, at: int | None = None) -> int | None:
        """End as CANCELLED (``at`` None: every slot is dropped) or FAILED (positions before ``at`` are
        still served, then ``error``); the budget bytes of the slots dropped (None: already over)."""
        with self.cond:
            if self.state in (ENDED if at is not None else (ReaderState.DONE, ReaderState.CANCELLED)):
                return None
            self.stopping, self.error = True, error
            if at is not None:
                self.end = min(self.end, at)
            cut = self.served if at is None else self.end  # slots lie in [served, read)
            freed = sum(self.slots.pop(pos).held for pos in [p for p in self.slots if p >= cut])
            self.ready = min(self.ready, cut)
            self.ready_bytes = sum(self.slots[p].nbytes for p in range(self.served, self.ready))
            self.set_state(ReaderState.CANCELLED if at is None else ReaderState.FAILED)
        return freed


class Handover:
    """Who reads one stream: its reader thread, or, warm over shared memory, its consumer.

    The consumer claims the positions from ``read`` on (``claim``: only while
    the stream is warm, unhinted, and read past ``claim_from``); the reader
    thread parks between two runs (``park``) and the consumer moves ``served
    == ready == read`` on by what it served itself (``done``), until it gives
    reading back (``release`` when its generator ends, ``give_back`` when it
    cannot serve a position: no claim before the reader has read past it).

    Invariants (under ``ReadAhead.cond``): ``parked`` only while the reader
    thread waits in ``park``, entered with ``claimed`` set, no transaction
    open and no budget reserved, left once ``claimed`` is cleared or the
    reader stops; a direct run starts only at ``served == ready`` while
    ``parked`` (everything read ahead is served first).
    """

    def __init__(self, shared: ReadAhead, schedule: Schedule, guess: PageCacheGuess, *, explicit_reads: bool,
                 on_read_all: Callable[[], None]) -> None:
        self._shared, self.schedule, self.guess = shared, schedule, guess
        self._explicit_reads, self._on_read_all = explicit_reads, on_read_all
        self.claimed = self.parked = False
        self.claim_from = 0  # after a run was given back: not before the reader has read this far
        #: The reader's probes still tell the kernel what to read (cold data); a warm group's start paused.
        self.hinting = not guess.warm

    def claim(self, direct_entries: int) -> None:
        """The consumer takes over reading if it may: it serves straight from the store. Caller holds ``cond``."""
        shared = self._shared
        # WAITING: the reader thread waits for its budget turn; it parks as soon as it starts reading
        if (direct_entries > 0 and not self.claimed and shared.state in (ReaderState.WAITING, ReaderState.READING)
                and not self.hinting
                and shared.read >= self.claim_from and self.guess.warm and self._explicit_reads):
            self.claimed = True  # the reader thread parks once its current run is published

    def park(self) -> None:
        """On the reader thread: wait while the consumer serves directly (the position moves on under it)."""
        shared = self._shared
        with shared.cond:
            self.parked = True
            shared.cond.notify_all()
            shared.cond.wait_for(lambda: shared.stopping or not self.claimed)
            self.parked = False
        if shared.stopping:
            raise Stop

    def release(self) -> None:
        """The consumer stops reading directly: the reader thread reads on."""
        with self._shared.cond:
            if self.claimed:
                self.claimed = False
                self._shared.cond.notify_all()

    def give_back(self, position: int) -> None:
        """The consumer could not serve ``position`` directly: the reader thread reads it (and on)."""
        with self._shared.cond:
            self.claim_from = position + 1
        self.release()

    def done(self, start: int, served: int, counts: dict) -> None:
        """The consumer served ``served`` positions from ``start`` on from the store (a direct run)."""
        shared, ended = self._shared, False
        with shared.cond:
            shared.served = shared.ready = shared.read = start + served
            if shared.read >= len(self.schedule) and shared.state is ReaderState.READING:
                shared.set_state(ReaderState.READ_ALL)
                ended = True
        self.schedule.counters.add(**counts)
        if ended:
            self._on_read_all()
