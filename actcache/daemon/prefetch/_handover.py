"""The hand-over of a warm stream's reading from its reader thread to its consumer (direct runs) and back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from actcache.daemon.prefetch._readahead import ReadAhead, ReaderState, Stop

if TYPE_CHECKING:
    from actcache.daemon.prefetch._schedule import Schedule
    from actcache.daemon.store import PageCacheGuess

__all__ = ["Handover"]


class Handover:
    """Who reads one stream: its reader thread, or, warm over shared memory, its consumer.

    The consumer claims the positions from ``read`` on (``claim``: only
    while the stream is warm, its probes have stopped hinting the kernel and
    the reader has read past ``claim_from``). The reader thread sees the claim
    between two runs, closes its transaction and parks (``park``): while
    ``parked`` it holds no transaction and reads nothing, and the consumer
    moves ``served == ready == read`` on by the positions it served itself
    (``done``). The consumer gives reading back when its generator ends
    (``release``) or when it cannot serve a position (``give_back``: no claim
    again before the reader has read past it); the reader thread then reads on.

    Invariants (under the shared ``ReadAhead.cond``): ``parked`` only while
    the reader thread waits in ``park``, which it enters with ``claimed`` set,
    no transaction open and no budget reserved, and leaves once ``claimed``
    is cleared or the reader stops; a direct run starts only at ``served ==
    ready`` while ``parked`` (everything read ahead is served first).
    """

    def __init__(self, shared: ReadAhead, schedule: Schedule, guess: PageCacheGuess, *, explicit_reads: bool,
                 on_read_all: Callable[[], None]) -> None:
        self._shared, self.schedule, self.guess = shared, schedule, guess
        self._explicit_reads = explicit_reads
        self._on_read_all = on_read_all
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
